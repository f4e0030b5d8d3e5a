"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' log_softmax of the same checkpoint's
logits, float32: one step, chunked prefill, a prefix-cache hit, n=2, preemption, tensor parallelism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from paged import LLM, SamplingParams
from tests.hf_checkpoints import build_checkpoint, hf_log_softmax

TOP = 5


def _prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, 400, length).tolist()


def _check(prompt_logprobs, prompt: list[int], reference: np.ndarray, top: int = TOP) -> None:
    """`prompt_logprobs` (vLLM's layout) against float64 log-probabilities [len, V] of transformers."""
    assert len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry, row = prompt_logprobs[position], reference[position - 1]
        token = prompt[position]
        actual = entry[token]
        assert actual.logprob == pytest.approx(row[token], abs=1e-4), position
        # Rank 1 is the most likely; a near tie within float32's reach may order either way.
        assert (np.sum(row > row[token] + 1e-5) + 1) <= actual.rank <= (np.sum(row > row[token] - 1e-5) + 1)
        ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if tid != token or lp.rank <= top)
        tops = [r for r in ranked if r[0] <= top]
        assert [r[0] for r in tops] == list(range(1, top + 1)), position
        expected = np.sort(row)[::-1][:top]
        np.testing.assert_allclose([r[2] for r in tops], expected, atol=1e-4)
        for _, tid, logprob in tops:
            assert logprob == pytest.approx(row[tid], abs=1e-4)
        assert len(entry) in (top, top + 1)  # the prompt's token is added when it is not among the top


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: build_checkpoint(name, str(tmp_path_factory.mktemp(name)))
            for name in ("llama-gqa", "qwen2-tied", "gemma2", "gpt2")}


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2-tied", "gemma2", "gpt2"])
def test_prompt_logprobs_equal_transformers(checkpoints, family):
    """Whole prompts in one step, and the same prompts in chunks of 16 tokens (each chunk's logits predict
    the next chunk's first token across the boundary)."""
    directory = checkpoints[family]
    prompts = [_prompt(n, seed=n) for n in (37, 5, 2)]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    for chunk in (256, 16):
        llm = LLM(directory, dtype="float32", max_num_batched_tokens=chunk, max_num_seqs=4, max_model_len=128,
                  enable_prefix_caching=False, show_progress=False)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, output in zip(prompts, outputs):
            _check(output.prompt_logprobs, prompt, hf_log_softmax(directory, prompt))


def test_only_the_prompts_token_with_zero(checkpoints):
    directory = checkpoints["llama-gqa"]
    prompt = _prompt(9, seed=1)
    llm = LLM(directory, dtype="float32", show_progress=False)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    reference = hf_log_softmax(directory, prompt)
    assert out.prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        (token, logprob), = out.prompt_logprobs[position].items()
        assert token == prompt[position]
        assert logprob.logprob == pytest.approx(reference[position - 1, token], abs=1e-4)
        assert logprob.decoded_token == llm.get_tokenizer().decode([token])
    assert out.outputs[0].logprobs is None  # sample logprobs are a separate request


def test_a_cached_prefix_is_computed_again_for_its_logprobs(checkpoints):
    """The prefix cache holds K/V, not logits: a request asking for prompt logprobs computes its whole prompt
    (no holes), and one that does not still hits the cache."""
    directory = checkpoints["llama-gqa"]
    prompt = _prompt(40, seed=2)
    llm = LLM(directory, dtype="float32", block_size=8, enable_prefix_caching=True, show_progress=False)
    plain = SamplingParams(temperature=0, max_tokens=3)
    first = llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)[0]
    assert first.prompt_logprobs is None
    again = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=TOP),
                         use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    _check(again.prompt_logprobs, prompt, hf_log_softmax(directory, prompt))
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    hit = llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 32  # the cache still serves requests that do not ask for them


def test_n_samples_share_one_set(checkpoints):
    directory = checkpoints["qwen2-tied"]
    prompt = _prompt(21, seed=3)
    llm = LLM(directory, dtype="float32", show_progress=False)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=TOP),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 2
    _check(out.prompt_logprobs, prompt, hf_log_softmax(directory, prompt))


def test_preemption_keeps_them_whole(checkpoints):
    """Recomputing a preempted request's prompt neither duplicates nor drops an entry."""
    directory = checkpoints["llama-gqa"]
    prompts = [_prompt(n, seed=n) for n in (30, 17, 24, 12, 28, 9)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=2)
    llm = LLM(directory, dtype="float32", block_size=8, num_kv_blocks=14, max_model_len=96,
              max_num_batched_tokens=32, show_progress=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        _check(output.prompt_logprobs, prompt, hf_log_softmax(directory, prompt), top=2)


def test_prompt_logprobs_are_bounded():
    with pytest.raises(ValueError, match="prompt_logprobs must be None or an integer in"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


TP_SCRIPT = textwrap.dedent("""
    import json, sys
    from paged import LLM, SamplingParams
    directory, prompt = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(directory, dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=16,
              compilation_cache_dir=None, show_progress=False)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=3),
                       use_tqdm=False)[0]
    print("RESULT " + json.dumps([None] + [{str(t): [lp.logprob, lp.rank] for t, lp in entry.items()}
                                           for entry in out.prompt_logprobs[1:]]))
""")


def test_tensor_parallel_two_devices(checkpoints):
    """Over 2 simulated devices (the LM head split by vocabulary), in chunks."""
    directory = checkpoints["llama-gqa"]
    prompt = _prompt(33, seed=4)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    run = subprocess.run([sys.executable, "-c", TP_SCRIPT, directory, json.dumps(prompt)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))
    from paged.outputs import Logprob
    got = [None] + [{int(t): Logprob(lp, rank) for t, (lp, rank) in entry.items()}
                    for entry in json.loads(line[7:])[1:]]
    _check(got, prompt, hf_log_softmax(directory, prompt), top=3)
