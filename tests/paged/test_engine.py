"""Engine-level behaviour: continuous batching, static shapes, preemption, no leaks."""

from __future__ import annotations

import numpy as np
import pytest

from paged import LLM, SamplingParams
from paged.request import RequestStatus
from tests.native import needs_compiler


def _all_blocks_free(engine) -> bool:
    bm = engine.block_manager
    return (bm.num_free_blocks == bm.num_usable_blocks and not bm.ref_counts.any()
            and len(bm.free_rows) == bm.page_table.shape[0] and not bm.page_table.any())


def _ids(n, seed=0, vocab=400):
    return np.random.default_rng(seed).integers(2, vocab, size=n).tolist()


def _add(engine, request_id, token_ids, params):
    """Submits a request; returns its (only) sequence."""
    parent = engine.make_request(request_id, None, token_ids, params)
    engine.add_request(parent)
    return parent.leader


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_request_added_while_others_decode_is_served_next_step(tiny_model_dir, async_scheduling):
    llm = LLM(tiny_model_dir, block_size=8, max_num_seqs=16, max_num_batched_tokens=128, max_model_len=256,
              async_scheduling=async_scheduling, show_progress=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    first = _add(engine, "join-a", _ids(10), params)
    engine.step()  # prefill
    engine.step()  # decode
    assert first.num_output_tokens == 2  # with async scheduling, the second is still in flight
    second = _add(engine, "join-b", _ids(12, seed=1), params)
    outputs = engine.step()
    assert second.num_computed_tokens == 12, "the new request must be prefilled in the very next step"
    assert first.num_output_tokens == 3, "running requests keep decoding while the newcomer prefills"
    if async_scheduling:  # that step's outputs come back from the next call
        assert {o.request_id for o in outputs} == {"join-a"}
        assert [len(o.outputs[0].token_ids) for o in outputs] == [2]
        outputs = engine.step()
    produced = {o.request_id: len(o.outputs[0].token_ids) for o in outputs}
    assert produced == {"join-a": 3, "join-b": 1}
    for request_id in ("join-a", "join-b"):
        engine.abort_request(request_id)
    assert not engine.has_unfinished_requests()
    assert _all_blocks_free(engine)


def test_long_prompt_is_chunked_without_stalling_decode(tiny_model_dir):
    llm = LLM(tiny_model_dir, block_size=8, max_num_batched_tokens=32, max_model_len=256, show_progress=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short = _add(engine, "short", _ids(4), params)
    engine.step()
    long = _add(engine, "long", _ids(100, seed=2), params)
    for _ in range(4):  # 100 prompt tokens at <= 31 per step (one slot goes to the decode)
        before = short.num_output_tokens
        engine.step()
        assert short.num_output_tokens == before + 1
    assert long.num_computed_tokens == 100 and long.num_output_tokens == 1
    # Chunked prefill gives the same tokens as prefilling in one go.
    whole = LLM(tiny_model_dir, block_size=8, max_num_batched_tokens=256, max_model_len=256,
                enable_chunked_prefill=False, show_progress=False)
    expected = whole.generate({"prompt_token_ids": long.prompt_token_ids}, params, use_tqdm=False)[0]
    while engine.has_unfinished_requests():
        engine.step()
    assert long.output_token_ids == expected.outputs[0].token_ids
    assert _all_blocks_free(engine)


def test_no_compilation_after_warmup(tiny_model_dir):
    llm = LLM(tiny_model_dir, block_size=8, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=128,
              show_progress=False)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True, seed=1)
    rng = np.random.default_rng(0)

    def traffic(batch_sizes):
        for n in batch_sizes:
            prompts = [{"prompt_token_ids": _ids(int(rng.integers(1, 60)), seed=int(rng.integers(1 << 30)))}
                       for _ in range(n)]
            llm.generate(prompts, params, use_tqdm=False)

    llm.engine.precompile()
    warm = llm.engine.num_compilations
    # Per step shape, the step and its prompt logprobs; for the adjusted rows, the LM head and the draw per
    # row count and the entries per (rows, entries) shape.
    adjusted = llm.engine.buckets.adjustment_shapes()
    assert warm == 2 * len(llm.engine.buckets.all_shapes()) + 2 * len({r for r, _ in adjusted}) + len(adjusted)
    traffic([1, 3, 16, 7, 2, 11, 16, 5])
    assert llm.engine.num_compilations == warm, "steady traffic must not trigger compilation"
    assert _all_blocks_free(llm.engine)


def test_preemption_recomputes_and_matches_unconstrained_run(tiny_model_dir):
    prompts = [{"prompt_token_ids": _ids(n, seed=n)} for n in (5, 17, 30, 9, 24, 12)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(tiny_model_dir, block_size=8, max_model_len=96, show_progress=False)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(tiny_model_dir, block_size=8, num_kv_blocks=14, max_model_len=96, show_progress=False)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.num_preemptions > 0
    assert got == expected
    assert _all_blocks_free(tight.engine)


def test_seeded_sampling_survives_preemption(tiny_model_dir):
    prompts = [{"prompt_token_ids": _ids(n, seed=n)} for n in (5, 17, 30, 9, 24, 12)]
    params = [SamplingParams(temperature=1.0, top_k=50, max_tokens=40, ignore_eos=True, seed=i) for i in range(6)]
    roomy = LLM(tiny_model_dir, block_size=8, max_model_len=96, show_progress=False)
    tight = LLM(tiny_model_dir, block_size=8, num_kv_blocks=14, max_model_len=96, show_progress=False)
    a = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.num_preemptions > 0
    assert a == b


def test_abort_frees_blocks_of_running_and_waiting_requests(tiny_llm):
    engine = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    requests = [_add(engine, f"abort-{i}", _ids(20, seed=i), params) for i in range(20)]
    engine.step()
    assert any(r.status is RequestStatus.RUNNING for r in requests)
    assert any(r.status is RequestStatus.WAITING for r in requests)
    for r in requests:
        engine.abort_request(r.request_id)
    assert all(r.finish_reason == "abort" for r in requests)
    assert not engine.has_unfinished_requests()
    assert _all_blocks_free(engine)


def test_pool_too_small_for_one_sequence_is_rejected(tiny_model_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_model_dir, block_size=8, num_kv_blocks=4, max_model_len=256, show_progress=False)


@pytest.mark.parametrize("backend, layer_loop", [("xla", "scan"), ("xla", "unroll"),
                                                 pytest.param("cpu", "unroll", marks=needs_compiler),
                                                 pytest.param("cpu", "scan", marks=needs_compiler)])
def test_cpu_backend_paths_match_the_reference(tiny_model_dir, backend, layer_loop):
    """Few sequence slots and a small token budget force every attention path: for the XLA backend paged
    rows, fresh prompts in the dense tail, a continuing prompt's cached prefix, and the general fallback
    when two continuing prompts share a tail; for the native kernel, decodes and prompt chunks of every
    length in one call. Scanned and unrolled layers give the same tokens."""
    prompts = [{"prompt_token_ids": _ids(n, seed=n)} for n in (70, 5, 90, 33, 61, 12)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = LLM(tiny_model_dir, block_size=8, max_model_len=128, attention_backend="reference",
                    enable_chunked_prefill=False, max_num_batched_tokens=512, show_progress=False)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    for seqs, budget in ((4, 48), (2, 40), (3, 100)):
        llm = LLM(tiny_model_dir, block_size=8, max_model_len=128, max_num_seqs=seqs,
                  max_num_batched_tokens=budget, enable_prefix_caching=False, attention_backend=backend,
                  layer_loop=layer_loop, show_progress=False)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected, (seqs, budget)


@needs_compiler
def test_bfloat16_pool_writes_match_xla_through_swap_and_copy_on_write(tiny_model_dir, monkeypatch):
    """A bf16 pool on CPU is written by the native calls (tokens, copy-on-write blocks, swapped-in blocks);
    the same run with XLA's scatter everywhere gives the same tokens. (Against a run without preemption the
    tokens may differ: bf16 matmuls round differently in other batch shapes, and sampling can follow.)"""
    from paged.kernels import cpu
    prompts = [{"prompt_token_ids": _ids(n, seed=n)} for n in (5, 17, 30, 9, 24, 12)]
    params = [SamplingParams(temperature=1.0, n=2, max_tokens=30, ignore_eos=True, seed=i) for i in range(6)]

    def run():
        llm = LLM(tiny_model_dir, dtype="bfloat16", block_size=8, max_model_len=96, num_kv_blocks=20,
                  preemption_mode="swap", show_progress=False)
        moves = {"copy": 0, "swap_in": 0}
        for name in moves:
            original = getattr(llm.engine.worker.mover, name)

            def counted(*args, _name=name, _original=original):
                moves[_name] += _name == "swap_in" or bool(args[0])  # copy() is called with no pairs too
                return _original(*args)
            setattr(llm.engine.worker.mover, name, counted)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert _all_blocks_free(llm.engine)
        return moves, [[c.token_ids for c in o.outputs] for o in outputs]

    assert cpu.writes_pool_natively("bfloat16")
    native_moves, native = run()
    assert native_moves["swap_in"] > 0 and native_moves["copy"] > 0
    monkeypatch.setattr(cpu, "writes_pool_natively", lambda dtype: False)
    xla_moves, xla = run()
    assert xla_moves == native_moves
    assert xla == native
