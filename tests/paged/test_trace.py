"""The engine trace: its sums are the engine's own counters; its exports hold one entry per step."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paged import LLM, SamplingParams


@pytest.fixture(scope="module")
def traced(tiny_model_dir):
    # A pool small enough that the batch preempts (recompute), chunked prompts, async scheduling on.
    llm = LLM(tiny_model_dir, block_size=8, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128,
              num_kv_blocks=20, show_progress=False)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(5, 400, size=n).tolist()} for n in (40, 5, 17, 60, 9, 33)]
    engine = llm.engine
    before = (engine.step_timings["steps"], engine.num_preemptions, engine.num_computed_prompt_tokens)
    engine.start_trace()
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    trace = engine.stop_trace()
    after = (engine.step_timings["steps"], engine.num_preemptions, engine.num_computed_prompt_tokens)
    return trace, outputs, [b - a for a, b in zip(before, after)]


def test_sums_agree_with_the_engine_counters(traced):
    trace, outputs, (steps, preemptions, prompt_tokens) = traced
    records = trace.records
    assert len(records) == steps and preemptions > 0
    assert sum(len(r.preempted) for r in records) == preemptions
    assert sum(r.prompt_tokens for r in records) == prompt_tokens
    assert sum(sum(r.sampled) for r in records) == sum(len(o.outputs[0].token_ids) for o in outputs)
    assert all(r.num_tokens <= 32 and len(r.request_ids) <= 8 for r in records)  # the step's budgets
    # Every prompt token is computed at least once (more after a recompute preemption).
    assert sum(sum(r.prefill_tokens) for r in records) >= sum(len(o.prompt_token_ids) for o in outputs)
    times = [(r.scheduled_at, r.read_back_at) for r in records]
    assert all(t1 is not None and t1 >= t0 for t0, t1 in times)
    assert [t0 for t0, _ in times] == sorted(t0 for t0, _ in times)


def test_dataframe_and_chrome_trace(traced, tmp_path):
    trace = traced[0]
    frame = trace.to_dataframe()
    assert len(frame) == len(trace.records)
    assert frame["num_tokens"].sum() == sum(r.num_tokens for r in trace.records)
    path = tmp_path / "trace.json"
    trace.write_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    assert sum(e["tid"] == 1 and e["pid"] == 0 for e in complete) == len(trace.records)  # the device track
    request_tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["pid"] == 1 and "tid" in e}
    assert request_tracks == {rid for r in trace.records for rid in r.request_ids}


def test_stop_without_start_says_so(tiny_llm):
    with pytest.raises(RuntimeError, match="start_trace"):
        tiny_llm.engine.stop_trace()


def test_context_tokens_are_what_each_row_has_computed(tiny_model_dir):
    """A step's context_tokens (what its attention reads) is the sum over its rows of each request's tokens
    computed so far, counted from the trace's own prefill and decode tokens (no preemption, no prefix hits)."""
    llm = LLM(tiny_model_dir, block_size=8, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
              enable_prefix_caching=False, show_progress=False)
    llm.engine.start_trace()
    llm.generate([{"prompt_token_ids": list(range(5, 5 + n))} for n in (40, 3, 9)],
                 SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    trace = llm.engine.stop_trace()
    computed: dict[str, int] = {}
    for record in trace.records:
        expected = 0
        for request_id, prefill, decode in zip(record.request_ids, record.prefill_tokens, record.decode_tokens):
            computed[request_id] = computed.get(request_id, 0) + prefill + decode
            expected += computed[request_id]
        assert record.context_tokens == expected, record.step
    assert any(sum(r.prefill_tokens) and sum(r.decode_tokens) for r in trace.records)  # mixed steps too
