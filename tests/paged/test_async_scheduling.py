"""Async scheduling (step t+1 scheduled and launched while step t runs) gives exactly the synchronous outputs.

The workload mixes what interacts with a token still in flight: early stops (stop token ids, stop strings,
EOS) that leave a speculative row to discard, seeded sampling (the sample index counts in-flight tokens),
n > 1 forks, logprobs, min_tokens, a penalised request (those make the engine wait for the token), prefix
caching, chunked prefill, and preemption by recompute and by swap.
"""

from __future__ import annotations

import numpy as np
import pytest

from paged import LLM, SamplingParams
from paged.request import PLACEHOLDER


def _workload():
    rng = np.random.default_rng(0)
    shared = rng.integers(2, 400, size=24).tolist()  # a common prefix for the prefix cache
    stop_ids = rng.choice(np.arange(2, 400), size=30, replace=False).tolist()
    prompts, params = [], []
    for i in range(14):
        own = rng.integers(2, 400, size=int(rng.integers(3, 50))).tolist()
        prompts.append({"prompt_token_ids": (shared + own) if i % 3 == 0 else own})
        kind = i % 7
        if kind == 0:
            p = SamplingParams(temperature=0, max_tokens=int(rng.integers(5, 40)), ignore_eos=True)
        elif kind == 1:
            p = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=i, max_tokens=30, stop_token_ids=stop_ids)
        elif kind == 2:
            p = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=stop_ids[:12], min_tokens=4,
                               logprobs=3)
        elif kind == 3:
            p = SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=25, stop_token_ids=stop_ids[:10])
        elif kind == 4:
            p = SamplingParams(temperature=0, max_tokens=30, stop=["e", "a "])
        elif kind == 5:
            p = SamplingParams(temperature=0.7, seed=i, max_tokens=20, presence_penalty=0.5, frequency_penalty=0.2)
        else:
            p = SamplingParams(temperature=0, max_tokens=35)  # stops at EOS if the model samples it
        params.append(p)
    return prompts, params


def _summary(outputs):
    """Per request and sample: what must match exactly, and the logprobs, which may differ in the last bits
    (the speculative rows change the steps' batch sizes, so the same rows can run in other kernels)."""
    exact = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
               [sorted((token, lp.rank) for token, lp in step.items()) for step in c.logprobs or []])
              for c in o.outputs] for o in outputs]
    logprobs = [lp.logprob for o in outputs for c in o.outputs for step in c.logprobs or [] for lp in step.values()]
    cumulative = [c.cumulative_logprob or 0.0 for o in outputs for c in o.outputs]
    return exact, np.array(logprobs + cumulative)


@pytest.mark.parametrize("engine_args", [
    dict(max_num_batched_tokens=64),
    dict(max_num_batched_tokens=64, num_kv_blocks=24, max_model_len=128),
    dict(max_num_batched_tokens=64, num_kv_blocks=24, max_model_len=128, preemption_mode="swap"),
], ids=["chunked", "recompute", "swap"])
def test_async_scheduling_matches_synchronous(tiny_model_dir, engine_args):
    prompts, params = _workload()
    results, engines = {}, {}
    for mode in (False, True):
        llm = LLM(tiny_model_dir, block_size=8, max_num_seqs=8, async_scheduling=mode, show_progress=False,
                  **engine_args)
        results[mode] = _summary(llm.generate(prompts, params, use_tqdm=False))
        engines[mode] = llm.engine
    (exact, logprobs), (sync_exact, sync_logprobs) = results[True], results[False]
    assert exact == sync_exact
    np.testing.assert_allclose(logprobs, sync_logprobs, rtol=1e-5, atol=1e-5)
    assert len(logprobs) > 100
    finish_reasons = {c[2] for o in exact for c in o}
    assert finish_reasons == {"stop", "length"}, "the workload must stop some requests early"
    engine = engines[True]
    if "num_kv_blocks" in engine_args:
        assert engine.num_preemptions > 0, "the small pool must force preemption"
    if engine_args.get("preemption_mode") == "swap":
        assert engine.scheduler.num_swaps > 0
    assert engine.block_manager.num_used_blocks == 0
    assert all(PLACEHOLDER not in c[0] for o in exact for c in o)


def test_outputs_never_show_tokens_in_flight(tiny_model_dir):
    """Streaming outputs (one per engine step) carry only tokens read back, and grow by one per output."""
    llm = LLM(tiny_model_dir, block_size=8, async_scheduling=True, show_progress=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request(engine.make_request("s", None, list(range(5, 25)), params))
    seen = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen.append(list(output.outputs[0].token_ids))
    assert [len(s) for s in seen] == list(range(1, 13))
    assert all(PLACEHOLDER not in s and s == seen[-1][:len(s)] for s in seen)
    expected = LLM(tiny_model_dir, block_size=8, async_scheduling=False, show_progress=False).generate(
        {"prompt_token_ids": list(range(5, 25))}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert seen[-1] == expected


def test_abort_while_a_step_is_in_flight(tiny_model_dir):
    llm = LLM(tiny_model_dir, block_size=8, async_scheduling=True, show_progress=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i in range(3):
        engine.add_request(engine.make_request(f"a{i}", None, list(range(3 + i, 30)), params))
    for _ in range(3):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_request("a1")
    assert engine.requests["a0"].leader.token_ids[-1] == PLACEHOLDER
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
    assert set(outputs) == {"a0", "a2"}, "the aborted request's in-flight row is dropped"
    assert all(len(o.outputs[0].token_ids) == 50 for o in outputs.values())
    assert engine.block_manager.num_used_blocks == 0
