"""Speculative decoding with a draft model (paged/draft_model.py): the target's tokens are unchanged whatever the
draft proposes (the target itself as its draft: most proposals accepted; a smaller random model with the same
tokenizer: most rejected), seeded samples and logprobs too, under preemption and structured outputs, with
nothing compiled after precompile()."""

from __future__ import annotations

import numpy as np
import pytest

from paged import LLM, SamplingParams
from paged.models.tiny import create_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 400, size=int(rng.integers(4, 30))).tolist() for _ in range(count)]


def _run(llm, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _tokens(llm, prompts, params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in _run(llm, prompts, params)]


def _draft(model: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory) -> str:
    """Half the width and layers of the tiny target, other weights: the same tokenizer and vocabulary."""
    return create_tiny_llama(str(tmp_path_factory.mktemp("tiny-draft")), hidden_size=32, intermediate_size=64,
                             num_layers=1, num_heads=2, num_kv_heads=1, seed=5)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    prompts = _prompts(6)
    return prompts, _tokens(LLM(tiny_model_dir, show_progress=False), prompts)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_the_target_as_its_own_draft_is_accepted_and_keeps_the_tokens(tiny_model_dir, reference, async_scheduling):
    prompts, want = reference
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=_draft(tiny_model_dir),
              async_scheduling=async_scheduling)
    assert _tokens(llm, prompts) == want
    stats = llm.engine.spec_stats
    # Its own argmax: rejected only where float32 sums in another order break a near tie.
    assert stats.num_drafts > 0 and stats.acceptance_rate > 0.9
    assert stats.mean_acceptance_length > 3


def test_a_small_random_draft_keeps_the_tokens(tiny_model_dir, small_draft, reference):
    prompts, want = reference
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=_draft(small_draft, k=4))
    assert _tokens(llm, prompts) == want
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert llm.engine.draft.model_config.num_layers == 1


def test_seeded_samples_and_logprobs_keep_their_values(tiny_model_dir, small_draft):
    """Each verified position draws with its own key as without proposals: a seeded request's tokens and
    logprobs do not depend on the draft (n > 1 and greedy rows beside it)."""
    prompts = _prompts(4, seed=2)
    params = [SamplingParams(temperature=0.8, seed=11 + i, max_tokens=16, ignore_eos=True, logprobs=2, top_k=20,
                             n=2 if i == 1 else 1) if i % 2 else GREEDY for i in range(4)]
    plain = _run(LLM(tiny_model_dir, show_progress=False), prompts, params)
    for draft in (tiny_model_dir, small_draft):
        fast = _run(LLM(tiny_model_dir, show_progress=False, speculative_config=_draft(draft)), prompts, params)
        for a, b in zip(plain, fast):
            assert [o.token_ids for o in b.outputs] == [o.token_ids for o in a.outputs]
            for x, y in zip(a.outputs, b.outputs):
                if x.logprobs is not None:
                    assert y.cumulative_logprob == pytest.approx(x.cumulative_logprob, abs=1e-4)


def test_preemption_frees_the_draft_pool_and_keeps_the_tokens(tiny_model_dir, reference):
    prompts, want = reference
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=_draft(tiny_model_dir), num_kv_blocks=12,
              block_size=8, max_model_len=64)
    assert _tokens(llm, prompts) == want
    assert llm.engine.num_preemptions > 0 and llm.engine.spec_stats.num_accepted_tokens > 0
    draft = llm.engine.draft
    _tokens(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=1))  # a step with nothing else running
    assert len(draft.sequences) <= 1


def test_long_prompts_catch_up_in_chunks(tiny_model_dir, small_draft):
    """A prompt longer than a step's token budget reaches the draft over several steps, then proposes."""
    prompts = _prompts(2, seed=9)
    prompts = [p * 8 for p in prompts]  # 32 to 240 tokens, a budget of 32
    want = _tokens(LLM(tiny_model_dir, show_progress=False, max_num_batched_tokens=32), prompts)
    llm = LLM(tiny_model_dir, show_progress=False, max_num_batched_tokens=32,
              speculative_config=_draft(tiny_model_dir))
    assert _tokens(llm, prompts) == want
    assert llm.engine.spec_stats.acceptance_rate > 0.9


def test_nothing_compiles_after_precompile(tiny_model_dir, small_draft):
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=_draft(small_draft),
              max_num_batched_tokens=64, max_num_seqs=8)
    llm.engine.precompile()
    compiled = llm.engine.num_compilations
    assert llm.engine.draft.num_compilations > 0
    prompts = _prompts(10, seed=4)
    lengths = [SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True) for n in range(3, 23, 2)]
    _tokens(llm, prompts, lengths)
    _tokens(llm, [p * 4 for p in prompts[:3]], GREEDY)
    assert llm.engine.num_compilations == compiled


def test_structured_outputs_verify_the_drafts_proposals(tiny_model_dir):
    schema = {"type": "object", "required": ["id"], "additionalProperties": False,
              "properties": {"id": {"type": "integer"}}}
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs={"json": schema})
    prompts = _prompts(3, seed=5)
    want = _tokens(LLM(tiny_model_dir, show_progress=False), prompts, params)
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=_draft(tiny_model_dir))
    assert _tokens(llm, prompts, params) == want


def test_a_draft_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    other = create_tiny_llama(str(tmp_path / "other"), vocab_size=300)
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        LLM(tiny_model_dir, show_progress=False, speculative_config=_draft(other))


def test_the_demo_models_draft_is_built_in():
    """The committed draft checkpoint shares the demo model's tokenizer and proposes what it would say often."""
    llm = LLM("paged-demo-docstrings", show_progress=False, max_model_len=256,
              speculative_config=_draft("paged-demo-docstrings-draft", k=4))
    prompt = "Return the number of items in the"
    plain = LLM("paged-demo-docstrings", show_progress=False, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=40)
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == \
        plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.spec_stats.num_accepted_tokens > 0


TP_SCRIPT = """
import json, sys
from paged import LLM, SamplingParams
model, draft, prompts = json.loads(sys.argv[1])
params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
want = LLM(model, show_progress=False).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
llm = LLM(model, tensor_parallel_size=2, show_progress=False,
          speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
print("RESULT " + json.dumps([[list(o.outputs[0].token_ids) for o in outs] for outs in (want, got)]
                             + [llm.engine.spec_stats.num_accepted_tokens]))
"""


def test_a_tensor_parallel_target_keeps_its_tokens(tiny_model_dir):
    """The target sharded over two devices, the draft on one beside it."""
    import json
    import os
    import subprocess
    import sys
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    run = subprocess.run([sys.executable, "-c", TP_SCRIPT, json.dumps([tiny_model_dir, tiny_model_dir, _prompts(4)])],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    want, got, accepted = json.loads(lines[0][len("RESULT "):])
    assert got == want and accepted > 0


FAMILIES = ["llama-gqa", "mistral-window", "phi3-fused", "gpt2", "gemma2", "gemma3", "glm", "qwen3-moe"]


@pytest.mark.torch
@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_keeps_its_tokens_with_itself_as_draft(name, tmp_path_factory):
    """Each family's tiny checkpoint drafting for itself (sliding windows, soft caps, MoE routing in the draft's
    passes too): the tokens of the same engine without speculation, most proposals accepted."""
    pytest.importorskip("torch")
    from tests.hf_checkpoints import build_checkpoint
    model = build_checkpoint(name, str(tmp_path_factory.mktemp(name)))
    prompts = _prompts(3, seed=7)
    want = _tokens(LLM(model, show_progress=False, dtype="float32"), prompts)
    llm = LLM(model, show_progress=False, dtype="float32", speculative_config=_draft(model))
    assert _tokens(llm, prompts) == want
    assert llm.engine.spec_stats.acceptance_rate > 0.5


def test_the_memory_budget_holds_the_drafts_pool_too(tiny_model_dir):
    """A draft's pool has as many blocks as the target's: under one kv_cache_memory_bytes, a draft as large
    as the target halves the blocks. (A tiny-model block: K and V x 2 layers x 2 KV heads x 8 tokens x 16
    dims x 4 bytes = 4 KiB.)"""
    options = dict(show_progress=False, block_size=8, max_model_len=64, kv_cache_memory_bytes=400 * 1024)
    assert LLM(tiny_model_dir, **options).engine.worker.num_blocks == 100
    assert LLM(tiny_model_dir, speculative_config=_draft(tiny_model_dir, k=2), **options).engine.worker.num_blocks == 50
