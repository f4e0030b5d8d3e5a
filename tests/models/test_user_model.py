"""A model of the user's own (tests/models/user_model.py), registered with `paged.register_model`: served with
paging, batching and sampling by `LLM` and by `paged serve` (loaded there as a plugin), its greedy tokens
equal to a float64 numpy forward pass of the same weights."""

from __future__ import annotations

import os

import pytest

import paged
from paged import LLM, SamplingParams
from paged.models.registry import model_class
from tests.models.user_model import ARCHITECTURE, TinyUserLM, reference_greedy, write_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [[5, 9, 13, 200], [7, 7, 30, 2, 44, 61, 3, 8, 150], [300, 1]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_checkpoint(str(tmp_path_factory.mktemp("user-model")))


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
def test_registered_model_decodes_as_its_reference(checkpoint, layer_loop):
    llm = LLM(checkpoint, show_progress=False, block_size=8, max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=128, layer_loop=layer_loop)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [reference_greedy(checkpoint, p, 12) for p in PROMPTS]


def test_registered_model_serves_through_paged_serve(checkpoint):
    openai = pytest.importorskip("openai")
    from tests.serving.server_fixture import Server
    env = {"PAGED_PLUGINS": "tests.models.user_model", "PYTHONPATH": REPO}
    server = Server(checkpoint, "--max-model-len", "128", env=env, cwd=REPO)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        reply = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                          logprobs=0, extra_body={"ignore_eos": True})
        want = reference_greedy(checkpoint, PROMPTS[1], 8)
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        assert reply.choices[0].logprobs.tokens == [tokenizer.decode([t]) for t in want]
    finally:
        server.stop()


def test_register_model_checks_its_arguments_and_resolves_lazily():
    with pytest.raises(ValueError, match="non-empty string"):
        paged.register_model("", TinyUserLM)
    with pytest.raises(ValueError, match="module:Class"):
        paged.register_model("Lazy", "tests.models.user_model.TinyUserLM")
    with pytest.raises(ValueError, match="a class or"):
        paged.register_model("Lazy", object())
    paged.register_model("LazyUserLM", "tests.models.user_model:TinyUserLM")
    assert model_class("LazyUserLM") is TinyUserLM
    assert model_class(ARCHITECTURE) is TinyUserLM
    with pytest.raises(ValueError, match="register your own"):
        model_class("NoSuchForCausalLM")
