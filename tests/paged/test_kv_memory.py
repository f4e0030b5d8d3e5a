"""KV memory management: prefix caching, parallel sampling with shared blocks, swap and recompute."""

from __future__ import annotations

import numpy as np
import pytest

from paged import LLM, SamplingParams


def _ids(n, seed):
    return np.random.default_rng(seed).integers(2, 400, size=n).tolist()


def _llm(model_dir, **kw):
    args = dict(block_size=8, max_model_len=128, show_progress=False)
    args.update(kw)
    return LLM(model_dir, **args)


def _no_leaks(engine):
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert not bm.ref_counts.any(), "a block is still referenced"
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert not bm.page_table.any() and len(bm.free_rows) == bm.page_table.shape[0]
    assert engine.worker.mover.swapped_blocks == 0


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


SYSTEM = _ids(40, seed=99)  # a shared "system prompt" of 5 blocks of 8
SHARED_PREFIX = [{"prompt_token_ids": SYSTEM + _ids(n, seed=n)} for n in (3, 11, 8, 20, 1, 15)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_prefix_caching_skips_shared_prompt_tokens_with_identical_output(tiny_model_dir):
    off = _llm(tiny_model_dir, enable_prefix_caching=False)
    expected = off.generate(SHARED_PREFIX[:1], GREEDY, use_tqdm=False) + off.generate(SHARED_PREFIX[1:], GREEDY,
                                                                                     use_tqdm=False)
    on = _llm(tiny_model_dir, enable_prefix_caching=True)
    first = on.generate(SHARED_PREFIX[:1], GREEDY, use_tqdm=False)
    rest = on.generate(SHARED_PREFIX[1:], GREEDY, use_tqdm=False)
    assert _tokens(first + rest) == _tokens(expected)
    assert first[0].num_cached_tokens == 0
    # Each later prompt finds the 5 system-prompt blocks (40 tokens) already computed.
    assert [o.num_cached_tokens for o in rest] == [40] * 5
    assert on.engine.num_computed_prompt_tokens == off.engine.num_computed_prompt_tokens - 5 * 40
    stats = on.engine.kv_stats()
    assert stats["prefix_cache_hits"] >= 25 and stats["prefix_cache_queries"] > stats["prefix_cache_hits"]
    _no_leaks(on.engine)
    _no_leaks(off.engine)


def test_identical_prompt_recomputes_only_its_last_token(tiny_model_dir):
    llm = _llm(tiny_model_dir)
    prompt = {"prompt_token_ids": _ids(32, seed=5)}  # exactly 4 blocks
    a = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    before = llm.engine.num_computed_prompt_tokens
    b = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert b.num_cached_tokens == 24  # the last block is recomputed: the step needs the last token's logits
    assert llm.engine.num_computed_prompt_tokens - before == 8
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    _no_leaks(llm.engine)


def test_cached_blocks_are_evicted_lru_when_memory_is_needed(tiny_model_dir):
    llm = _llm(tiny_model_dir, num_kv_blocks=20, max_model_len=96)
    for seed in range(6):  # each leaves ~5 cached blocks behind; the pool holds 19
        llm.generate({"prompt_token_ids": _ids(40, seed=seed)}, GREEDY, use_tqdm=False)
    bm = llm.engine.block_manager
    assert len(bm.cached) <= bm.num_usable_blocks
    # The most recent prompt is still cached; the first one was evicted.
    again = llm.generate([{"prompt_token_ids": _ids(40, seed=5)}, {"prompt_token_ids": _ids(40, seed=0)}],
                         GREEDY, use_tqdm=False)
    assert again[0].num_cached_tokens == 32 and again[1].num_cached_tokens == 0
    _no_leaks(llm.engine)


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tight_pool_matches_unconstrained_run(tiny_model_dir, mode, prefix_caching):
    prompts = SHARED_PREFIX + [{"prompt_token_ids": _ids(n, seed=100 + n)} for n in (30, 9, 50)]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30, ignore_eos=True, seed=3)] * 5
    params = params[:len(prompts)]
    roomy = _llm(tiny_model_dir, enable_prefix_caching=False)
    expected = _tokens(roomy.generate(prompts, params, use_tqdm=False))
    tight = _llm(tiny_model_dir, num_kv_blocks=16, max_model_len=96, preemption_mode=mode,
                 enable_prefix_caching=prefix_caching)
    got = _tokens(tight.generate(prompts, params, use_tqdm=False))
    stats = tight.engine.kv_stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swaps"] > 0
    else:
        assert stats["num_swaps"] == 0
    assert got == expected
    _no_leaks(tight.engine)


def test_swap_falls_back_to_recompute_when_swap_space_is_full(tiny_model_dir):
    prompts = [{"prompt_token_ids": _ids(n, seed=n)} for n in (30, 9, 50, 22, 41)]
    expected = _tokens(_llm(tiny_model_dir).generate(prompts, GREEDY, use_tqdm=False))
    tiny_swap = _llm(tiny_model_dir, num_kv_blocks=16, max_model_len=96, preemption_mode="swap",
                     swap_space=2 * 2 * 2 * 2 * 8 * 16 * 4 / 2**30)  # room for exactly two blocks
    assert tiny_swap.engine.worker.mover.swap_blocks == 2
    assert _tokens(tiny_swap.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert tiny_swap.engine.kv_stats()["num_preemptions"] > tiny_swap.engine.kv_stats()["num_swaps"]
    _no_leaks(tiny_swap.engine)


def _peak_blocks(llm, prompts, params):
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(engine.make_request(f"peak-{id(prompts)}-{i}", None, p["prompt_token_ids"], sp))
    peak, outputs = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        peak = max(peak, engine.kv_stats()["num_used_blocks"])
    return peak, [outputs[k] for k in sorted(outputs)]


def test_parallel_sampling_shares_prompt_blocks(tiny_model_dir):
    prompt = {"prompt_token_ids": _ids(37, seed=7)}  # 4 full blocks + 5 tokens
    n4 = SamplingParams(n=4, temperature=1.0, max_tokens=20, ignore_eos=True, seed=11)
    shared = _llm(tiny_model_dir, enable_prefix_caching=False)
    peak_shared, (out,) = _peak_blocks(shared, [prompt], [n4])
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    singles = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=11 + i) for i in range(4)]
    separate = _llm(tiny_model_dir, enable_prefix_caching=False)
    peak_separate, outs = _peak_blocks(separate, [prompt] * 4, singles)
    # Sample i of n=4 is exactly what an independent request seeded seed + i produces.
    assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in outs]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4, "independently seeded samples differ"
    # Each sequence peaks at 56 computed tokens = 7 blocks of 8. Separate: 4 x 7. Shared: the 4 full prompt
    # blocks once, plus 3 private blocks per sample (the copied partial block and two for its output).
    assert peak_shared < peak_separate, (peak_shared, peak_separate)
    assert peak_separate == 4 * 7 and peak_shared == 4 + 4 * 3
    _no_leaks(shared.engine)
    _no_leaks(separate.engine)


def test_parallel_sampling_greedy_and_finish_on_first_token(tiny_model_dir):
    llm = _llm(tiny_model_dir)
    prompt = {"prompt_token_ids": _ids(16, seed=8)}  # block-aligned: the fork copies the last full block
    single = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    pair = llm.generate(prompt, SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [c.token_ids for c in pair[0].outputs] == [single, single]
    one = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, max_tokens=1, seed=1), use_tqdm=False)[0]
    assert all(len(c.token_ids) == 1 for c in one.outputs)
    _no_leaks(llm.engine)


def test_abort_parallel_request_mid_flight(tiny_model_dir):
    llm = _llm(tiny_model_dir)
    engine = llm.engine
    parent = engine.make_request("abort-n", None, _ids(20, seed=9),
                                 SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True))
    engine.add_request(parent)
    for _ in range(3):
        engine.step()
    engine.abort_request("abort-n")
    assert all(c.finish_reason == "abort" for c in parent.children)
    _no_leaks(engine)


def test_kv_utilization_counts_only_the_partial_tail_as_waste(tiny_model_dir):
    llm = _llm(tiny_model_dir, enable_prefix_caching=False)
    engine = llm.engine
    for i, n in enumerate((5, 17, 30)):
        engine.add_request(engine.make_request(f"u{i}", None, _ids(n, seed=n), GREEDY))
    engine.step()
    stats = engine.kv_stats()
    # 5 + 17 + 30 = 52 live tokens in 1 + 3 + 4 = 8 blocks of 8 slots (a block per sequence holds the next token).
    assert stats["num_held_blocks"] == 8
    assert stats["kv_utilization"] == pytest.approx((5 + 17 + 30) / 64)
    for i in range(3):
        engine.abort_request(f"u{i}")
    _no_leaks(engine)
