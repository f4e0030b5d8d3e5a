"""The native CPU kernel (pallas_kernels/cpu) against a float64 numpy loop over the same pages.

The kernel must build on every CI machine (it needs only g++), so these tests fail rather than skip when it
does not: a silent fallback would leave the default CPU path untested.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged.kernels.cpu import (available, int8_matmul_cpu, matmul_cpu, matmul_transposed_argmax_cpu, matmul_transposed_cpu,
                               paged_attention_cpu, quant_matmul_cpu, w8a8_gated_matmul_cpu, w8a8_matmul_cpu)
from tests.native import needs_compiler
from tests.pallas_kernels.kernel_inputs import LAYER, attention_f64, random_pool, tolerance

pytestmark = needs_compiler


def test_kernel_builds_here():
    ok, reason = available()
    assert ok, reason


def _check(rng, *, num_q_heads, num_kv_heads, page_size, head_dim, dtype=np.float32, window=None, soft_cap=None,
           pages_per_seq=5, traced_window=False, target=None, q_scale=1.0, lengths=None):
    # Context lengths: 1, one page, a partial page, the whole table; one token per sequence plus, for the
    # longest, a few earlier positions (prompt tokens read the pages too). Given `lengths`: one decode each.
    if lengths is None:
        lengths = [1, page_size, 2 * page_size + 3, pages_per_seq * page_size]
        earlier = [0, page_size - 1, 3 * page_size + 1]
    else:
        earlier = []
    pool = random_pool(rng, len(lengths), pages_per_seq, num_kv_heads, page_size, head_dim, dtype)
    seq_ids = list(range(len(lengths))) + [len(lengths) - 1] * len(earlier)
    positions = [n - 1 for n in lengths] + earlier
    q = (q_scale * rng.normal(size=(len(seq_ids), num_q_heads, head_dim))).astype(dtype)
    scale = head_dim ** -0.5
    w = jnp.int32(window or 0) if traced_window else window
    run = jax.jit(lambda q, k, v, w: paged_attention_cpu(
        q, k, v, LAYER, jnp.asarray(pool.page_tables), jnp.asarray(seq_ids, jnp.int32),
        jnp.asarray(positions, jnp.int32), scale=scale, sliding_window=w, soft_cap=soft_cap,
        **({"_target": target} if target else {})))
    got = np.asarray(run(jnp.asarray(q), jnp.asarray(pool.k_pages), jnp.asarray(pool.v_pages), w), np.float64)
    want = np.zeros_like(got)
    for i, (seq, pos) in enumerate(zip(seq_ids, positions)):
        k, v = zip(*(pool.keys(seq, pos + 1, h) for h in range(num_kv_heads)))
        want[i] = attention_f64(q[i:i + 1].astype(np.float64), k, v, [pos], scale, window, soft_cap)[0]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, **tolerance(dtype))


@pytest.mark.parametrize("page_size", [8, 16, 32])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(2, 2), (4, 2), (8, 2), (16, 2), (4, 1), (6, 2), (14, 2),
                                                        (18, 2)],
                         ids=["mha", "gqa2", "gqa4", "gqa8", "mqa", "gqa3", "gqa7", "gqa9-generic"])
@pytest.mark.parametrize("head_dim", [64, 128, 40], ids=["d64", "d128", "d40-generic"])
def test_float32_matches_float64(page_size, num_q_heads, num_kv_heads, head_dim):
    rng = np.random.default_rng(page_size * 1000 + num_q_heads * 10 + num_kv_heads + head_dim)
    _check(rng, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, page_size=page_size, head_dim=head_dim)


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 2), (8, 1), (14, 2)])
def test_bfloat16(num_q_heads, num_kv_heads):
    rng = np.random.default_rng(num_q_heads)
    _check(rng, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, page_size=16, head_dim=64,
           dtype=jnp.bfloat16)


@pytest.mark.parametrize("window, traced", [(1, False), (13, False), (40, True), (0, True)])
@pytest.mark.parametrize("soft_cap", [None, 5.0])
def test_sliding_window_and_soft_cap(window, traced, soft_cap):
    rng = np.random.default_rng(window)
    _check(rng, num_q_heads=8, num_kv_heads=2, page_size=8, head_dim=64, window=window or None,
           soft_cap=soft_cap, traced_window=traced)


def _check_prompt_chunks(rng, *, num_q_heads, num_kv_heads, page_size, head_dim, dtype=np.float32, window=None,
                         soft_cap=None, target=None):
    """A mixed step as the engine packs it: decode tokens first, then prompt chunks (runs of consecutive
    positions of one sequence, which the kernel takes as tiles), one starting past a cached prefix, one
    longer than a tile, with padding tokens between and after."""
    pages_per_seq = 12
    pool = random_pool(rng, 5, pages_per_seq, num_kv_heads, page_size, head_dim, dtype)
    full = pages_per_seq * page_size
    seq_ids, positions = [0, 1], [page_size * 3 - 1, 0]  # decodes
    for seq, first, count in [(2, 0, 5), (-1, 0, 2), (3, page_size + 3, 2 * page_size + 1), (4, 0, full)]:
        seq_ids += [seq] * count
        positions += list(range(first, first + count))
    seq_ids += [-1] * 3
    positions += [0] * 3
    q = rng.normal(size=(len(seq_ids), num_q_heads, head_dim)).astype(dtype)
    scale = head_dim ** -0.5
    got = np.asarray(paged_attention_cpu(
        jnp.asarray(q), jnp.asarray(pool.k_pages), jnp.asarray(pool.v_pages), LAYER, jnp.asarray(pool.page_tables),
        jnp.asarray(seq_ids, jnp.int32), jnp.asarray(positions, jnp.int32), scale=scale, sliding_window=window,
        soft_cap=soft_cap, **({"_target": target} if target else {})), np.float64)
    want = np.zeros_like(got)
    for i, (seq, pos) in enumerate(zip(seq_ids, positions)):
        if seq < 0:
            continue
        k, v = zip(*(pool.keys(seq, pos + 1, h) for h in range(num_kv_heads)))
        want[i] = attention_f64(q[i:i + 1].astype(np.float64), k, v, [pos], scale, window, soft_cap)[0]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, **tolerance(dtype))


@pytest.mark.parametrize("page_size", [8, 16, 32])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(2, 2), (8, 2), (16, 2), (4, 1), (6, 2)],
                         ids=["mha", "gqa4", "gqa8", "mqa", "gqa3-generic"])
@pytest.mark.parametrize("head_dim", [64, 40], ids=["d64", "d40-generic"])
def test_prompt_chunks_match_float64(page_size, num_q_heads, num_kv_heads, head_dim):
    rng = np.random.default_rng(page_size * 100 + num_q_heads * 7 + head_dim)
    _check_prompt_chunks(rng, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, page_size=page_size,
                         head_dim=head_dim)


@pytest.mark.parametrize("window, soft_cap", [(5, None), (20, 5.0), (None, 5.0)])
def test_prompt_chunks_window_soft_cap(window, soft_cap):
    _check_prompt_chunks(np.random.default_rng(1), num_q_heads=8, num_kv_heads=2, page_size=16, head_dim=128,
                         window=window, soft_cap=soft_cap)


def test_prompt_chunks_bfloat16():
    _check_prompt_chunks(np.random.default_rng(2), num_q_heads=8, num_kv_heads=2, page_size=16, head_dim=64,
                         dtype=jnp.bfloat16)


def _check_long_prompts(rng, *, num_q_heads, num_kv_heads, head_dim, window=None, target=None):
    """bfloat16 prompt chunks over pages of 16 as the AMX tiles take them (amx_attention.cc): prompts longer
    than a 256-key segment and than a 256-row tile, one continuing a cached prefix, short and odd-length ones
    (an odd page count leaves half a 32-key block), a decode between them, and every key slot no token may
    read (past each sequence's last position, and the pool's spare pages) set to NaN, as stale pages can be."""
    page_size, pages_per_seq = 16, 45
    chunks = [(0, 0, 600), (1, 300, 420), (2, 0, 37), (3, 0, 1), (4, 5, 11)]
    pool = random_pool(rng, len(chunks) + 1, pages_per_seq, num_kv_heads, page_size, head_dim, jnp.bfloat16)
    seq_ids, positions = [5], [200]  # a decode
    for seq, first, count in chunks:
        seq_ids += [seq] * count
        positions += list(range(first, first + count))
    seq_ids += [-1] * 2
    positions += [0] * 2
    last = {seq: max(p for s, p in zip(seq_ids, positions) if s == seq) for seq in set(seq_ids) if seq >= 0}
    owned = np.zeros(pool.k_pages.shape[2], bool)
    for seq, table in enumerate(pool.page_tables):
        owned[table] = True
        stale = np.arange(pages_per_seq * page_size) > last.get(seq, -1)
        for cache in (pool.k_pages, pool.v_pages):
            pages = cache[LAYER][:, table].reshape(num_kv_heads, -1, head_dim)
            pages[:, stale] = np.nan
            cache[LAYER][:, table] = pages.reshape(num_kv_heads, pages_per_seq, page_size, head_dim)
    for cache in (pool.k_pages, pool.v_pages):
        cache[LAYER][:, ~owned] = np.nan
    q = rng.normal(size=(len(seq_ids), num_q_heads, head_dim)).astype(jnp.bfloat16)
    scale = head_dim ** -0.5
    got = np.asarray(paged_attention_cpu(
        jnp.asarray(q), jnp.asarray(pool.k_pages), jnp.asarray(pool.v_pages), LAYER, jnp.asarray(pool.page_tables),
        jnp.asarray(seq_ids, jnp.int32), jnp.asarray(positions, jnp.int32), scale=scale, sliding_window=window,
        **({"_target": target} if target else {})), np.float64)
    want = np.zeros_like(got)
    for i, (seq, pos) in enumerate(zip(seq_ids, positions)):
        if seq < 0:
            continue
        k, v = zip(*(pool.keys(seq, pos + 1, h) for h in range(num_kv_heads)))
        want[i] = attention_f64(q[i:i + 1].astype(np.float64), k, v, [pos], scale, window)[0]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, **tolerance(jnp.bfloat16))


@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(14, 2, 64), (8, 2, 128), (4, 4, 64), (8, 1, 256),
                                                                 (12, 4, 96)],
                         ids=["qwen0.5b", "gqa4-d128", "mha", "mqa-d256", "gqa3-d96"])
@pytest.mark.parametrize("window", [None, 5, 40, 300])
def test_long_prompts_bfloat16_match_float64(num_q_heads, num_kv_heads, head_dim, window):
    rng = np.random.default_rng(num_q_heads * 1000 + head_dim + (window or 0))
    _check_long_prompts(rng, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, window=window)


def test_long_prompts_bfloat16_without_amx_match_float64():
    """The same inputs through the float32 FMA tiles (the build without AMX), which AMX machines skip."""
    from paged.kernels import cpu as cpu_kernel
    target = cpu_kernel.matmul_target_without_amx().replace("matmul_cpu", "paged_attention_cpu")
    _check_long_prompts(np.random.default_rng(3), num_q_heads=14, num_kv_heads=2, head_dim=64, window=40,
                        target=target)


@pytest.mark.parametrize("head_dim", [32, 80, 96])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(14, 2), (4, 4)], ids=["gqa7", "mha"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_other_head_dims_match_float64(head_dim, num_q_heads, num_kv_heads, dtype):
    """head_dims beside 64/128/256 that checkpoints use (32: small models, 80: Phi-2, 96: Phi-3) take the
    fixed-size paths: decodes and prompt chunks."""
    rng = np.random.default_rng(head_dim + num_q_heads)
    kwargs = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, page_size=16, head_dim=head_dim, dtype=dtype)
    _check(rng, **kwargs)
    _check_prompt_chunks(rng, **kwargs)


# Decodes seeing more than 2,048 keys are split into parts whose results are combined (split-KV); shorter ones
# in the same call are not. Queries 3x larger make each softmax peaked, so outputs are O(1) and a part
# weighted wrongly moves them far beyond the tolerance.
LONG_DECODES = [6400, 2049, 2048, 5000, 37, 4097]
@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, dtype",
                         [(14, 2, 64, jnp.bfloat16), (8, 2, 128, np.float32), (18, 2, 40, np.float32)],
                         ids=["gqa7-bf16", "gqa4-f32", "gqa9-d40-generic"])
@pytest.mark.parametrize("window, soft_cap", [(None, None), (3000, None), (2500, 5.0)])
def test_long_decodes_split_over_parts_match_float64(page_size, num_q_heads, num_kv_heads, head_dim, dtype, window,
                                                     soft_cap):
    rng = np.random.default_rng(page_size + num_q_heads + (window or 0))
    _check(rng, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, page_size=page_size, head_dim=head_dim,
           dtype=dtype, window=window, soft_cap=soft_cap, pages_per_seq=6400 // page_size, q_scale=3.0,
           lengths=LONG_DECODES)


@pytest.fixture(scope="module")
def portable_target():
    """The kernel built without AVX-512: the portable loops that AVX-512 machines (like CI's) otherwise skip
    for pages of 16."""
    import platform

    from paged.kernels import cpu as cpu_kernel
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("-mno-avx512f is an x86 flag; elsewhere the default build is already the portable one")
    target = "paged_attention_cpu_portable"
    reason = cpu_kernel._load(cpu_kernel._FLAGS + ("-mno-avx512f",), target)
    assert reason is None, reason
    return target


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(2, 2), (8, 2), (16, 2), (4, 1)],
                         ids=["mha", "gqa4", "gqa8", "mqa"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_portable_build_matches_float64(portable_target, num_q_heads, num_kv_heads, head_dim, dtype):
    rng = np.random.default_rng(num_q_heads + head_dim)
    kwargs = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, page_size=16, head_dim=head_dim, dtype=dtype,
                  target=portable_target)
    _check(rng, **kwargs)
    _check(rng, window=13, soft_cap=5.0, **kwargs)
    _check(rng, window=3000, pages_per_seq=400, q_scale=3.0, lengths=LONG_DECODES, **kwargs)  # split-KV
    _check_prompt_chunks(rng, **kwargs)


def test_tokens_without_a_sequence_get_zeros():
    rng = np.random.default_rng(0)
    pool = random_pool(rng, 2, 3, 2, 8, 64, np.float32)
    q = jnp.asarray(rng.normal(size=(3, 4, 64)).astype(np.float32))
    out = paged_attention_cpu(q, jnp.asarray(pool.k_pages), jnp.asarray(pool.v_pages), 0,
                              jnp.asarray(pool.page_tables), jnp.asarray([0, -1, 5], jnp.int32),
                              jnp.asarray([4, 4, 4], jnp.int32), scale=0.125)
    assert np.abs(np.asarray(out[0])).sum() > 0
    np.testing.assert_array_equal(np.asarray(out[1:]), 0.0)


def test_bad_inputs_are_refused_and_the_process_survives():
    rng = np.random.default_rng(0)
    pool = random_pool(rng, 2, 3, 2, 8, 64, np.float32)
    k, v = jnp.asarray(pool.k_pages), jnp.asarray(pool.v_pages)
    q = jnp.zeros((2, 4, 64), jnp.float32)
    ids, pos = jnp.asarray([0, 1], jnp.int32), jnp.asarray([3, 3], jnp.int32)
    bad_table = jnp.asarray(pool.page_tables).at[1, 0].set(10_000)
    with pytest.raises(Exception, match="page table entry outside the pool"):
        paged_attention_cpu(q, k, v, 0, bad_table, ids, pos, scale=0.125).block_until_ready()
    with pytest.raises(Exception, match="past its page table"):
        paged_attention_cpu(q, k, v, 0, jnp.asarray(pool.page_tables), ids, jnp.asarray([3, 24], jnp.int32),
                            scale=0.125).block_until_ready()
    with pytest.raises(Exception, match="layer index out of range"):
        paged_attention_cpu(q, k, v, 7, jnp.asarray(pool.page_tables), ids, pos, scale=0.125).block_until_ready()
    with pytest.raises(ValueError, match="share a dtype"):
        paged_attention_cpu(q.astype(jnp.float16), k, v, 0, jnp.asarray(pool.page_tables), ids, pos, scale=0.125)
    with pytest.raises(ValueError, match="does not fit the pool"):
        paged_attention_cpu(jnp.zeros((2, 3, 64)), k, v, 0, jnp.asarray(pool.page_tables), ids, pos, scale=0.125)
    # Still usable after the refusals.
    out = paged_attention_cpu(q + 1, k, v, 0, jnp.asarray(pool.page_tables), ids, pos, scale=0.125)
    assert np.isfinite(np.asarray(out)).all()


# ---- the decode-sized matmul (cpu/matmul.cc) ---------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 48, 64, 192])
@pytest.mark.parametrize("inner, cols", [(64, 64), (200, 192), (300, 320), (512, 1536)])
def test_matmul_matches_float64(rows, inner, cols):
    """Every remainder of the 6-row register tile, and inner sizes that end mid-block (200 = 128 + 72).
    float32 sums of up to 512 products of N(0,1) values: errors stay near 1e-5 x sqrt(512); 2e-4 leaves room
    without hiding a wrong product (which moves an output by ~1)."""
    rng = np.random.default_rng(rows * 1000 + inner + cols)
    x = rng.normal(size=(rows, inner)).astype(np.float32)
    w = rng.normal(size=(inner, cols)).astype(np.float32)
    got = np.asarray(matmul_cpu(jnp.asarray(x), jnp.asarray(w)), np.float64)
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.astype(np.float64), atol=2e-4, rtol=2e-5)


def test_matmul_portable_build_matches_float64(portable_target):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(13, 200)).astype(np.float32)
    w = rng.normal(size=(200, 192)).astype(np.float32)
    target = portable_target.replace("paged_attention_cpu", "matmul_cpu")
    got = np.asarray(matmul_cpu(jnp.asarray(x), jnp.asarray(w), _target=target), np.float64)
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.astype(np.float64), atol=2e-4, rtol=2e-5)


def _bf16_case(rows, inner, cols, seed):
    """bfloat16 operands and their exact float64 product: the products of two bf16 values are exact in
    float32, so the kernel's error is float32 accumulation alone, as for the float32 path."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(rows, inner)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(inner, cols)), jnp.bfloat16)
    return x, w, np.asarray(x, np.float64) @ np.asarray(w, np.float64)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 48, 192])
@pytest.mark.parametrize("inner, cols", [(64, 64), (200, 192), (302, 320), (896, 128)])
def test_matmul_bfloat16_matches_float64(rows, inner, cols):
    """Every row remainder; inner sizes inside one block (200) and ending mid-block (302 = 256 + 46); every column of the
    64-column panel, whose register order the pair interleave permutes (a wrong un-permute moves whole
    columns, an error of ~1 against the 2e-4 allowed). Float32 result."""
    x, w, want = _bf16_case(rows, inner, cols, rows * 1000 + inner + cols)
    got = matmul_cpu(x, w)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-4, rtol=2e-5)


@pytest.fixture(scope="module")
def avx512_bf16_target():
    """The kernel built without AMX: the AVX-512 BF16 dot-product path, which AMX machines (like CI's) would
    otherwise never run for bfloat16."""
    from paged.kernels import cpu as cpu_kernel
    if " amx_bf16 " not in _cpu_flags():
        pytest.skip("no AMX here: the default build already runs the AVX-512 BF16 path (the tests above)")
    return cpu_kernel.matmul_target_without_amx()


def _cpu_flags() -> str:
    from pathlib import Path
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.read_text().replace("\n", " ") + " " if cpuinfo.exists() else ""


@pytest.mark.parametrize("rows", [1, 16, 17, 31, 32, 33, 100, 520])
@pytest.mark.parametrize("inner, cols", [(96, 64), (302, 320), (600, 1216)])
def test_matmul_bfloat16_tiles_match_float64(rows, inner, cols):
    """The AMX path's edges (on a CPU without AMX these run the AVX-512 BF16 path again): row blocks of 32
    and the 16-row tile for a last block of at most 16 rows; inner sizes that end mid tile step (302 = 9 x 32
    + 14) and span two 256-row weight blocks; 19 panels, more than a pass of 8 on each of two threads."""
    x, w, want = _bf16_case(rows, inner, cols, rows * 7 + inner + cols)
    np.testing.assert_allclose(np.asarray(matmul_cpu(x, w), np.float64), want, atol=2e-4, rtol=2e-5)


@pytest.mark.parametrize("rows", [5, 64, 65])
def test_matmul_bfloat16_tiles_many_passes_match_float64(rows):
    """130 panels: two threads' ranges of 65, more than a pass of 64 of the decode-sized plan (64 rows or
    fewer) and many passes of 8 of the larger one."""
    x, w, want = _bf16_case(rows, 96, 130 * 64, rows)
    np.testing.assert_allclose(np.asarray(matmul_cpu(x, w), np.float64), want, atol=2e-4, rtol=2e-5)


@pytest.mark.parametrize("rows", [1, 6, 13, 48, 192])
@pytest.mark.parametrize("inner, cols", [(200, 192), (302, 320)])
def test_matmul_bfloat16_without_amx_matches_float64(avx512_bf16_target, rows, inner, cols):
    x, w, want = _bf16_case(rows, inner, cols, rows * 1000 + inner + cols)
    got = np.asarray(matmul_cpu(x, w, _target=avx512_bf16_target), np.float64)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-5)


@pytest.mark.parametrize("live", [0, 1, 16, 17, 33, 40])
def test_matmul_bfloat16_live_rows_ignore_the_padding(live):
    """Rows from live_rows on are zeros whatever they hold (NaN here), and the live rows are exactly what the
    whole product gives them, across row blocks of 32 and the last block's buffer."""
    x, w, _ = _bf16_case(40, 302, 192, live)
    x = np.asarray(x, np.float32)
    x[live:] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    got = np.asarray(jax.jit(matmul_cpu)(x, w, jnp.int32(live)))
    assert not np.any(got[live:])
    whole = np.asarray(matmul_cpu(jnp.nan_to_num(x)[:max(live, 1)], w))
    np.testing.assert_array_equal(got[:live], whole[:live])
    np.testing.assert_allclose(got[:live].astype(np.float64),
                               np.asarray(x[:live], np.float64) @ np.asarray(w, np.float64), atol=2e-4, rtol=2e-5)


def _needs_amx():
    from paged.kernels import cpu as cpu_kernel
    if not cpu_kernel.matmul_on_amx():
        pytest.skip("no AMX on this CPU: the bfloat16 products run on AVX-512 BF16 (tests above)")


@pytest.fixture(params=["default", "no-amx"])
def transposed(request):
    """(matmul_transposed_cpu, matmul_transposed_argmax_cpu) of one build: the default one (AMX tiles where the
    CPU has them, else AVX-512 BF16), and on an AMX machine also the build without AMX, whose AVX-512 BF16
    kernel (transposed.cc) that machine otherwise never runs."""
    from paged.kernels import cpu as cpu_kernel
    if request.param == "default":
        if not cpu_kernel.transposed_matmul_native():
            pytest.skip("neither AMX nor AVX-512 BF16 on this CPU: the tied LM head keeps XLA's dot")
        return matmul_transposed_cpu, matmul_transposed_argmax_cpu
    if not cpu_kernel.matmul_on_amx():
        pytest.skip("no AMX on this CPU: the default build already runs the AVX-512 BF16 kernel")
    base = cpu_kernel.matmul_target_without_amx()
    return (functools.partial(matmul_transposed_cpu, _target=base.replace("matmul_cpu", "matmul_transposed_cpu")),
            functools.partial(matmul_transposed_argmax_cpu,
                              _target=base.replace("matmul_cpu", "matmul_transposed_argmax_cpu")))


def _first_argmax_np(logits: np.ndarray) -> np.ndarray:
    """numpy's argmax with a NaN counting as +inf (`paged.sampler.first_argmax`)."""
    return np.argmax(np.where(np.isnan(logits), np.inf, logits), axis=-1).astype(np.int32)


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 33, 70])
@pytest.mark.parametrize("inner, vocab", [(32, 32), (96, 100), (896, 1000)])
def test_matmul_transposed_matches_float64(transposed, rows, inner, vocab):
    """x @ w^T with w [N, K] as stored (the tied LM head): row chunks of 32 and 16 (AMX), rows alone and in
    pairs (AVX-512 BF16), a table whose last block is partial (100, 1000), and threads splitting the table's
    blocks."""
    matmul_transposed_cpu, _ = transposed
    rng = np.random.default_rng(rows + inner + vocab)
    x = jnp.asarray(rng.normal(size=(rows, inner)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(vocab, inner)), jnp.bfloat16)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(np.asarray(matmul_transposed_cpu(x, w), np.float64), want, atol=2e-4, rtol=2e-5)


@pytest.mark.parametrize("live", [0, 1, 17, 40])
def test_matmul_transposed_live_rows(transposed, live):
    """Rows from live on are zeros (logits) and 0 (the fused greedy head's tokens) though their input is NaN."""
    matmul_transposed_cpu, matmul_transposed_argmax_cpu = transposed
    rng = np.random.default_rng(live)
    x = rng.normal(size=(40, 64)).astype(np.float32)
    x[live:] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(200, 64)), jnp.bfloat16)
    got = np.asarray(jax.jit(matmul_transposed_cpu)(x, w, jnp.int32(live)))
    assert not np.any(got[live:])
    np.testing.assert_allclose(got[:live].astype(np.float64),
                               np.asarray(x[:live], np.float64) @ np.asarray(w, np.float64).T, atol=2e-4, rtol=2e-5)
    # The fused greedy head over the same rows: their logits' first argmax, zeros past live.
    tokens = np.asarray(jax.jit(matmul_transposed_argmax_cpu)(x, w, jnp.int32(live)))
    assert not np.any(tokens[live:])
    np.testing.assert_array_equal(tokens[:live], _first_argmax_np(got[:live]))


def test_matmul_transposed_refuses_what_it_cannot_do(transposed):
    matmul_transposed_cpu, _ = transposed
    with pytest.raises(ValueError, match="multiple of 32"):
        matmul_transposed_cpu(jnp.zeros((4, 48), jnp.bfloat16), jnp.zeros((64, 48), jnp.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 operands"):
        matmul_transposed_cpu(jnp.zeros((4, 64)), jnp.zeros((64, 64)))


@pytest.mark.parametrize("rows", [1, 2, 17, 33, 70])
@pytest.mark.parametrize("inner, vocab", [(32, 1), (96, 5), (64, 100), (896, 1000)])
def test_matmul_transposed_argmax_is_the_logits_first_argmax(transposed, rows, inner, vocab):
    """The fused greedy LM head picks what the first argmax of the unfused call's float32 logits picks: one
    to several 32-row blocks, a partial last block, row chunks of 32 and 16, the table split over threads."""
    matmul_transposed_cpu, matmul_transposed_argmax_cpu = transposed
    rng = np.random.default_rng(rows * 7 + inner + vocab)
    x = jnp.asarray(rng.normal(size=(rows, inner)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(vocab, inner)), jnp.bfloat16)
    want = _first_argmax_np(np.asarray(matmul_transposed_cpu(x, w)))
    np.testing.assert_array_equal(np.asarray(matmul_transposed_argmax_cpu(x, w)), want)


@pytest.mark.parametrize("special, want", [
    ({300: 50.0, 700: 50.0}, 300),             # a tie across the threads' halves of the table
    ({3: 40.0, 9: 40.0}, 3),                   # a tie inside one block
    ({600: np.inf, 800: np.nan}, 600),         # +inf before a NaN: the +inf
    ({200: np.nan, 900: np.inf}, 200),         # a NaN counts as +inf, first
    ({999: 30.0}, 999),                        # the table's last row, in its partial last block
])
def test_matmul_transposed_argmax_ties_nan_and_infinities(transposed, special, want):
    """First index among equal maxima, NaN as +inf; x is e_0, so row n's product is w[n, 0] exactly."""
    matmul_transposed_cpu, matmul_transposed_argmax_cpu = transposed
    vocab, inner = 1000, 64
    w = np.random.default_rng(0).normal(size=(vocab, inner)).astype(np.float32)
    for row, value in special.items():
        w[row, 0] = value
    x = np.zeros((2, inner), np.float32)
    x[:, 0] = 1.0
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    got = np.asarray(matmul_transposed_argmax_cpu(xb, wb))
    np.testing.assert_array_equal(got, [want, want])
    np.testing.assert_array_equal(got, _first_argmax_np(np.asarray(matmul_transposed_cpu(xb, wb))))


def test_matmul_transposed_argmax_of_minus_infinity_is_the_first_index(transposed):
    matmul_transposed_cpu, matmul_transposed_argmax_cpu = transposed
    ones, minus_inf = jnp.ones((3, 64), jnp.bfloat16), jnp.full((1000, 64), -jnp.inf, jnp.bfloat16)
    assert np.all(np.isneginf(np.asarray(matmul_transposed_cpu(ones, minus_inf))))
    np.testing.assert_array_equal(np.asarray(matmul_transposed_argmax_cpu(ones, minus_inf)), [0, 0, 0])


def test_matmul_transposed_argmax_refuses_what_it_cannot_do(transposed):
    _, matmul_transposed_argmax_cpu = transposed
    with pytest.raises(ValueError, match="multiple of 32"):
        matmul_transposed_argmax_cpu(jnp.zeros((4, 48), jnp.bfloat16), jnp.zeros((64, 48), jnp.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 operands"):
        matmul_transposed_argmax_cpu(jnp.zeros((4, 64)), jnp.zeros((64, 64)))


def test_pack_for_amx_places_each_weight_where_the_tiles_read_it():
    """Against the layout as amx.h describes it, word by word: (p, s, t, i, c, e) holds w[32 s + 2 i + e,
    64 p + 16 t + c]; rows past K (here 70 of 96) are zeros; numpy and jax pack alike, and unpacking inverts."""
    from paged.kernels import cpu as cpu_kernel
    k, n = 70, 192
    w = np.arange(k * n, dtype=np.float32).reshape(k, n) + 1  # every word distinct and nonzero
    packed = cpu_kernel.pack_for_amx(w)
    assert packed.shape == (3, 3, 2048) == cpu_kernel.amx_packed_shape(k, n)
    words = packed.reshape(3, 3, 4, 16, 16, 2)
    for p, s, t, i, c, e in np.ndindex(words.shape):
        row, col = 32 * s + 2 * i + e, 64 * p + 16 * t + c
        assert words[p, s, t, i, c, e] == (w[row, col] if row < k else 0)
    np.testing.assert_array_equal(np.asarray(cpu_kernel.pack_for_amx(jnp.asarray(w))), packed)
    np.testing.assert_array_equal(cpu_kernel.unpack_from_amx(packed, k), w)
    stacked = np.stack([w, -w])  # leading (layer) axes pack slice by slice
    np.testing.assert_array_equal(cpu_kernel.pack_for_amx(stacked)[1], cpu_kernel.pack_for_amx(-w))


@pytest.mark.parametrize("rows", [1, 16, 17, 33, 64, 65, 100, 520])
@pytest.mark.parametrize("inner, cols", [(96, 64), (302, 320), (600, 1216)])
def test_matmul_packed_matches_float64(rows, inner, cols):
    """Weights packed at load (the engine's bfloat16 layout on AMX): decode-sized products (64 rows or fewer)
    read each panel's whole K, larger ones blocks of 512 rows of 8 panels; inner sizes ending mid tile step
    (302, 600) read the packing's zero rows; 19 panels split over two threads."""
    _needs_amx()
    from paged.kernels import cpu as cpu_kernel
    x, w, want = _bf16_case(rows, inner, cols, rows * 3 + inner + cols)
    got = cpu_kernel.matmul_packed_cpu(x, cpu_kernel.pack_for_amx(w))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-4, rtol=2e-5)


@pytest.mark.parametrize("rows", [5, 65])
def test_matmul_packed_many_panels_match_float64(rows):
    _needs_amx()
    from paged.kernels import cpu as cpu_kernel
    x, w, want = _bf16_case(rows, 96, 130 * 64, rows + 1)
    got = cpu_kernel.matmul_packed_cpu(x, cpu_kernel.pack_for_amx(w))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-4, rtol=2e-5)


@pytest.mark.parametrize("live", [0, 1, 17, 40])
def test_matmul_packed_live_rows_ignore_the_padding(live):
    """Rows from live_rows on are zeros whatever they hold (NaN), the live rows bit-equal to the unpacked
    kernel's product (the same tiles in the same order)."""
    _needs_amx()
    from paged.kernels import cpu as cpu_kernel
    x, w, _ = _bf16_case(40, 302, 192, live + 5)
    x = np.asarray(x, np.float32)
    x[live:] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    got = np.asarray(jax.jit(cpu_kernel.matmul_packed_cpu)(x, cpu_kernel.pack_for_amx(w), jnp.int32(live)))
    assert not np.any(got[live:])
    np.testing.assert_array_equal(got[:live], np.asarray(matmul_cpu(x, w, jnp.int32(live)))[:live])


def test_matmul_packed_refuses_what_it_cannot_do():
    _needs_amx()
    from paged.kernels import cpu as cpu_kernel
    packed = cpu_kernel.pack_for_amx(jnp.zeros((64, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match="packed weights"):
        cpu_kernel.matmul_packed_cpu(jnp.zeros((4, 96), jnp.bfloat16), packed)  # packed for K = 64
    with pytest.raises(ValueError, match="bfloat16 operands"):
        cpu_kernel.matmul_packed_cpu(jnp.zeros((4, 64)), packed)
    with pytest.raises(ValueError, match="multiple of 64"):
        cpu_kernel.pack_for_amx(np.zeros((64, 100), np.float32))


@pytest.mark.parametrize("rows", [1, 16, 17, 33, 65, 100])
@pytest.mark.parametrize("inner, cols", [(96, 64), (302, 320), (600, 1216)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matmul_packed_rounded_matches_float64(rows, inner, cols, with_bias):
    """The bfloat16 product with its bias added before the one rounding: against float64 of the same bfloat16
    operands, within half a bfloat16 step (at most 2^-8 of the value) plus the float32 sums' error (2e-4, as
    for the float32 product); and bit-equal to the float32 kernel's sums plus the bias, rounded by XLA. Decode-sized
    products (64 rows or fewer) round each block from registers; larger ones keep partial sums between blocks
    of 512 weight rows (600 inner: two blocks) and round after the last."""
    _needs_amx()
    from paged.kernels import cpu as cpu_kernel
    x, w, want = _bf16_case(rows, inner, cols, rows * 5 + inner + cols)
    bias = jnp.asarray(np.random.default_rng(rows).normal(size=cols), jnp.bfloat16) if with_bias else None
    if with_bias:
        want = want + np.asarray(bias, np.float64)
    packed = cpu_kernel.pack_for_amx(w)
    got = cpu_kernel.matmul_packed_rounded_cpu(x, packed, bias)
    assert got.dtype == jnp.bfloat16 and got.shape == (rows, cols)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-4, rtol=2 ** -8)
    sums = cpu_kernel.matmul_packed_cpu(x, packed)
    rounded = (sums + (0 if bias is None else bias.astype(jnp.float32))).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(rounded))


@pytest.mark.parametrize("live", [0, 1, 17, 40, 70])
def test_matmul_packed_rounded_live_rows_ignore_the_padding(live):
    """Rows from live_rows on are zeros (not the bias) whatever x holds there (NaN); the live rows equal the
    whole call's."""
    _needs_amx()
    from paged.kernels import cpu as cpu_kernel
    x, w, _ = _bf16_case(70, 302, 192, live + 11)
    packed = cpu_kernel.pack_for_amx(w)
    bias = jnp.full((192,), 0.5, jnp.bfloat16)
    _check_live_rows(lambda x, *live: cpu_kernel.matmul_packed_rounded_cpu(x, packed, bias, *live),
                     np.asarray(x, np.float32), live)


def _check_live_rows(call, x, live):
    """call(x) and call(x, live) through jit, x's rows from `live` on set to NaN for the second: those rows of
    the result are zeros, the rest bit-equal to the whole call's."""
    whole = np.asarray(call(jnp.asarray(x, jnp.bfloat16)))
    x = x.copy()
    x[live:] = np.nan
    got = np.asarray(jax.jit(call)(jnp.asarray(x, jnp.bfloat16), jnp.int32(live)))
    assert not np.any(got[live:].astype(np.float32))
    np.testing.assert_array_equal(got[:live], whole[:live])


def test_concurrent_native_calls_share_the_pool():
    """Independent native calls in one jitted function: XLA may run them at once on both of its pool threads,
    each also asking the pool for a helper (pallas_kernels/cpu/parallel.h: a helper that starts after the
    work is gone returns at once, so neither waits on the other). Every result equals the same call made
    alone, over repeated runs."""
    _needs_amx()
    from paged.kernels import cpu as cpu_kernel
    cases = [_bf16_case(rows, 302, 640, rows) for rows in (3, 40, 130, 7)]
    packed = [cpu_kernel.pack_for_amx(w) for _, w, _ in cases]
    alone = [np.asarray(cpu_kernel.matmul_packed_rounded_cpu(x, p)) for (x, _, _), p in zip(cases, packed)]
    together = jax.jit(lambda xs, ps: [cpu_kernel.matmul_packed_rounded_cpu(x, p) for x, p in zip(xs, ps)])
    xs = [x for x, _, _ in cases]
    for _ in range(20):
        for got, want in zip(together(xs, packed), alone):
            np.testing.assert_array_equal(np.asarray(got), want)


def test_matmul_packed_rounded_refuses_what_it_cannot_do():
    _needs_amx()
    from paged.kernels import cpu as cpu_kernel
    packed = cpu_kernel.pack_for_amx(jnp.zeros((64, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 bias \\[128\\]"):
        cpu_kernel.matmul_packed_rounded_cpu(jnp.zeros((4, 64), jnp.bfloat16), packed, jnp.zeros(64, jnp.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 bias"):
        cpu_kernel.matmul_packed_rounded_cpu(jnp.zeros((4, 64), jnp.bfloat16), packed, jnp.zeros(128))
    with pytest.raises(ValueError, match="packed weights"):
        cpu_kernel.matmul_packed_rounded_cpu(jnp.zeros((4, 96), jnp.bfloat16), packed)


@pytest.mark.parametrize("rows", [1, 16, 17, 33, 100])
@pytest.mark.parametrize("inner, cols", [(96, 64), (302, 320), (896, 1216)])
def test_gated_matmul_packed_matches_float64(rows, inner, cols):
    """silu(x @ gate) * (x @ up) in one call against float64 of the same bfloat16 operands: float32 sums and
    activation rounded once to bfloat16 (relative step 2^-8), so 2^-8 of the value plus 1e-3 absolute covers
    the float32 sums' error on values near zero. Gate weights are three times wider so the activation's
    negative half is exercised."""
    _needs_amx()
    from paged.kernels import cpu as cpu_kernel
    rng = np.random.default_rng(rows * 7 + inner + cols)
    x = jnp.asarray(rng.normal(size=(rows, inner)), jnp.bfloat16)
    gate = jnp.asarray(rng.normal(size=(inner, cols)) * 3 / np.sqrt(inner), jnp.bfloat16)
    up = jnp.asarray(rng.normal(size=(inner, cols)) / np.sqrt(inner), jnp.bfloat16)
    x64, gate64, up64 = (np.asarray(a, np.float64) for a in (x, gate, up))
    g = x64 @ gate64
    want = g / (1 + np.exp(-g)) * (x64 @ up64)
    got = cpu_kernel.gated_matmul_packed_cpu(x, cpu_kernel.pack_for_amx(gate), cpu_kernel.pack_for_amx(up))
    assert got.dtype == jnp.bfloat16 and got.shape == (rows, cols)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-3, rtol=2 ** -8)


@pytest.mark.parametrize("live", [0, 1, 17, 40])
def test_gated_matmul_packed_live_rows_ignore_the_padding(live):
    """Rows from live_rows on are zeros whatever they hold (NaN); the live rows equal the whole call's."""
    _needs_amx()
    from paged.kernels import cpu as cpu_kernel
    rng = np.random.default_rng(live)
    x = rng.normal(size=(40, 302)).astype(np.float32)
    gate, up = (cpu_kernel.pack_for_amx(jnp.asarray(rng.normal(size=(302, 192)) / 17, jnp.bfloat16)) for _ in "gu")
    _check_live_rows(lambda x, *live: cpu_kernel.gated_matmul_packed_cpu(x, gate, up, *live), x, live)


def test_gated_matmul_packed_refuses_what_it_cannot_do():
    _needs_amx()
    from paged.kernels import cpu as cpu_kernel
    gate = cpu_kernel.pack_for_amx(jnp.zeros((64, 128), jnp.bfloat16))
    up = cpu_kernel.pack_for_amx(jnp.zeros((64, 192), jnp.bfloat16))
    with pytest.raises(ValueError, match="of one N"):
        cpu_kernel.gated_matmul_packed_cpu(jnp.zeros((4, 64), jnp.bfloat16), gate, up)
    with pytest.raises(ValueError, match="of one N"):
        cpu_kernel.gated_matmul_packed_cpu(jnp.zeros((4, 96), jnp.bfloat16), gate, gate)
    with pytest.raises(ValueError, match="bfloat16 operands"):
        cpu_kernel.gated_matmul_packed_cpu(jnp.zeros((4, 64)), gate, gate)


def _argmax_cases(rng, vocab):
    """Rows that test first_argmax's semantics: plain, ties (the first wins), NaN (counts as +inf, the first
    of several wins), +inf before and after a NaN, all -inf, all NaN, the maximum in the last element."""
    x = rng.normal(size=(10, vocab)).astype(np.float32)
    last = vocab - 1
    x[1, [last // 3, last]] = 50.0
    x[2, [last // 2, last]] = np.nan
    x[3, last // 4] = np.inf
    x[3, last] = np.nan
    x[4, last] = np.inf
    x[4, last // 5] = np.nan
    x[5] = -np.inf
    x[6] = np.nan
    x[7, last] = 99.0
    x[8, 0] = np.nan
    return x


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 1000, 151936])
def test_argmax_rows_matches_first_argmax(vocab):
    """The native argmax against the sampler's jnp one and numpy (NaN as +inf, then np.argmax: the first
    maximum), at widths below, at and past one vector, with a tail, and at Qwen2.5's vocabulary."""
    from paged.kernels import cpu as cpu_kernel
    from paged.sampler import first_argmax
    x = _argmax_cases(np.random.default_rng(vocab), vocab)
    got = np.asarray(jax.jit(cpu_kernel.argmax_rows_cpu)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(np.where(np.isnan(x), np.inf, x), axis=1))
    np.testing.assert_array_equal(got, np.asarray(first_argmax(jnp.asarray(x))))


def test_argmax_rows_portable_build(portable_target):
    from paged.kernels import cpu as cpu_kernel
    x = _argmax_cases(np.random.default_rng(0), 1000)
    got = cpu_kernel.argmax_rows_cpu(jnp.asarray(x), _target=portable_target.replace("paged_attention_cpu",
                                                                                    "argmax_rows_cpu"))
    np.testing.assert_array_equal(np.asarray(got), np.argmax(np.where(np.isnan(x), np.inf, x), axis=1))
    with pytest.raises(ValueError, match="float32"):
        cpu_kernel.argmax_rows_cpu(jnp.zeros((2, 8), jnp.bfloat16))


def test_matmul_bfloat16_portable_build_matches_float64(portable_target):
    x, w, want = _bf16_case(13, 200, 192, 0)
    target = portable_target.replace("paged_attention_cpu", "matmul_cpu")
    got = np.asarray(matmul_cpu(x, w, _target=target), np.float64)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-5)


def _add_rms_norm_case(rows, width, seed):
    """bfloat16 h, delta and scale, the sum as bfloat16 rounds it, and float64 of the norm of the float32 sum."""
    rng = np.random.default_rng(seed)
    h, delta = (jnp.asarray(rng.normal(size=(rows, width)) * sd, jnp.bfloat16) for sd in (4.0, 1.0))
    scale = jnp.asarray(rng.normal(size=(width,)), jnp.bfloat16)
    s = np.asarray(h, np.float64) + np.asarray(delta, np.float64)  # exact in float32 too at these magnitudes
    normed = np.asarray(scale, np.float64) * s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + 1e-6)
    return h, delta, scale, np.asarray(jnp.asarray(s, jnp.bfloat16)), normed


@pytest.mark.parametrize("rows, width", [(1, 896), (32, 896), (130, 896), (5, 70), (3, 7)])
def test_add_rms_norm_matches_float64(rows, width):
    """The residual add and RMSNorm in one pass: the sum exactly as bfloat16 rounds it; the norm of the
    float32 sum rounded twice to bfloat16 (the normalised value, then times the scale), so within two
    bfloat16 steps (2^-7) of float64. Widths with a scalar tail, and more than 64 rows (split over threads)."""
    from paged.kernels import cpu as cpu_kernel
    h, delta, scale, want_sum, want_normed = _add_rms_norm_case(rows, width, rows + width)
    total, normed = jax.jit(lambda *a: cpu_kernel.add_rms_norm_cpu(*a, 1e-6))(h, delta, scale)
    assert total.dtype == normed.dtype == jnp.bfloat16 and total.shape == normed.shape == (rows, width)
    np.testing.assert_array_equal(np.asarray(total), want_sum)
    np.testing.assert_allclose(np.asarray(normed, np.float64), want_normed, rtol=2 ** -7, atol=1e-6)


def test_add_rms_norm_matches_the_jnp_norm():
    """Against paged.models.layers.RMSNorm's own formula on the float32 sum, as XLA computes it: equal but for
    products within a float32 ulp of a bfloat16 rounding boundary (the mean square sums in another order)."""
    from paged.kernels import cpu as cpu_kernel
    h, delta, scale, _, _ = _add_rms_norm_case(200, 896, 3)

    def jnp_norm(h, delta, scale):
        s = h.astype(jnp.float32) + delta.astype(jnp.float32)
        variance = jnp.mean(s * s, axis=-1, keepdims=True)
        return s.astype(jnp.bfloat16), scale * (s * jax.lax.rsqrt(variance + 1e-6)).astype(jnp.bfloat16)

    got = [np.asarray(a, np.float32) for a in cpu_kernel.add_rms_norm_cpu(h, delta, scale, 1e-6)]
    want = [np.asarray(a, np.float32) for a in jax.jit(jnp_norm)(h, delta, scale)]
    np.testing.assert_array_equal(got[0], want[0])
    differ = got[1] != want[1]
    assert differ.mean() < 1e-4, f"{differ.sum()} of {differ.size} differ"
    np.testing.assert_allclose(got[1], want[1], rtol=2 ** -7)


def test_add_rms_norm_portable_build(portable_target):
    from paged.kernels import cpu as cpu_kernel
    h, delta, scale, want_sum, want_normed = _add_rms_norm_case(9, 70, 1)
    total, normed = cpu_kernel.add_rms_norm_cpu(h, delta, scale, 1e-6, _target=portable_target.replace(
        "paged_attention_cpu", "add_rms_norm_cpu"))
    np.testing.assert_array_equal(np.asarray(total), want_sum)
    np.testing.assert_allclose(np.asarray(normed, np.float64), want_normed, rtol=2 ** -7, atol=1e-6)


def test_add_rms_norm_refuses_what_it_cannot_do():
    from paged.kernels import cpu as cpu_kernel
    h = jnp.zeros((4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="scale \\[D\\]"):
        cpu_kernel.add_rms_norm_cpu(h, h, jnp.zeros((32,), jnp.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="h and delta"):
        cpu_kernel.add_rms_norm_cpu(h, jnp.zeros((4, 32), jnp.bfloat16), jnp.zeros((64,), jnp.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="bfloat16 operands"):
        cpu_kernel.add_rms_norm_cpu(h, h.astype(jnp.float32), jnp.zeros((64,), jnp.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        cpu_kernel.add_rms_norm_cpu(h, h, jnp.zeros((64,), jnp.bfloat16), float("nan"))


def _quant_case(rows, inner, cols, bits, groups, seed):
    """Codes, per-group scales and the float64 product of x with codes * scales."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, inner)).astype(np.float32)
    codes = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), size=(inner, cols))
    scales = rng.uniform(0.01, 0.1, size=(groups, cols)).astype(np.float32)
    w = codes * scales.astype(np.float64)[np.arange(inner) // (inner // groups)]
    if bits == 8:
        packed = codes.astype(np.int8)
    else:
        nibbles = (codes + 8).astype(np.uint8)
        packed = nibbles[0::2] | (nibbles[1::2] << 4)
    return jnp.asarray(x), jnp.asarray(packed), jnp.asarray(scales), x.astype(np.float64) @ w


@pytest.mark.parametrize("rows", [1, 5, 6, 13, 64])
@pytest.mark.parametrize("bits, inner, groups", [(8, 512, 1), (8, 512, 4), (8, 256, 16), (4, 512, 4),
                                                 (4, 384, 1), (4, 512, 32), (4, 1024, 4)])
def test_quant_matmul_matches_float64(rows, bits, inner, groups):
    """int8 and packed int4 codes, groups of 16 to 512 rows (inside one 128-row block, or spanning several)
    and per channel; every 16-column quarter of the 64-column panel (192 columns). Scaled codes of up to 0.8:
    the float32 sums' errors stay near 1e-6 x sqrt(K)."""
    x, w, scales, want = _quant_case(rows, inner, 192, bits, groups, rows * 100 + inner + groups)
    got = np.asarray(quant_matmul_cpu(x, w, scales), np.float64)
    np.testing.assert_allclose(got, want, atol=2e-4 * 8, rtol=2e-5)


def _bf16_quant_case(rows, inner, cols, bits, groups, seed):
    """As _quant_case with x in bfloat16, and the float64 product of x as rounded."""
    x, w, scales, _ = _quant_case(rows, inner, cols, bits, groups, seed)
    xb = x.astype(jnp.bfloat16)
    codes = _unpacked_codes(np.asarray(w), bits)
    decoded = codes * np.asarray(scales, np.float64)[np.arange(inner) // (inner // groups)]
    return xb, w, scales, np.asarray(xb, np.float64) @ decoded


def _unpacked_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return packed.astype(np.int64)
    codes = np.empty((packed.shape[0] * 2, packed.shape[1]), np.int64)
    codes[0::2], codes[1::2] = (packed & 15).astype(np.int64) - 8, (packed >> 4).astype(np.int64) - 8
    return codes


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("bits, inner, groups", [(8, 512, 1), (8, 512, 4), (8, 256, 16), (8, 640, 1), (8, 768, 3),
                                                 (8, 256, 128), (4, 512, 4), (4, 384, 1), (4, 512, 32),
                                                 (4, 640, 5)])
def test_quant_matmul_bfloat16_x_matches_float64(rows, bits, inner, groups):
    """bfloat16 x: the codes widened to bfloat16 pairs (direct up to 6 rows, through the paired block beyond),
    the scales applied to each block's sums. Blocks of 256 rows where the groups allow (640 = 2 x 256 + 128:
    a short last block), 128 or the group's rows otherwise, down to pairs (groups of 2 rows). 320 columns: one
    row takes panels four at a time, two rows two at a time, and the fifth panel alone."""
    x, w, scales, want = _bf16_quant_case(rows, inner, 320, bits, groups, rows * 100 + inner + groups)
    got = np.asarray(quant_matmul_cpu(x, w, scales), np.float64)
    np.testing.assert_allclose(got, want, atol=2e-4 * 8, rtol=2e-5)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("panels", [3, 7, 9, 14])
@pytest.mark.parametrize("bits, inner, groups", [(8, 512, 1), (4, 384, 3)])
def test_quant_matmul_bfloat16_x_takes_panels_side_by_side(rows, panels, bits, inner, groups):
    """One row takes a thread's panels up to four at a time, two rows two at a time, and the run's last ones
    together (three, two or one): 3 to 14 panels over the pool's threads end their runs in every width."""
    x, w, scales, want = _bf16_quant_case(rows, inner, 64 * panels, bits, groups, rows * 10 + panels + bits)
    got = np.asarray(quant_matmul_cpu(x, w, scales), np.float64)
    np.testing.assert_allclose(got, want, atol=2e-4 * 8, rtol=2e-5)


def test_quant_matmul_portable_build_and_live_rows(portable_target):
    target = portable_target.replace("paged_attention_cpu", "quant_matmul_cpu")
    for case in (_quant_case, _bf16_quant_case):
        x, w, scales, want = case(13, 256, 128, 4, 2, 0)
        np.testing.assert_allclose(np.asarray(quant_matmul_cpu(x, w, scales, _target=target), np.float64), want,
                                   atol=2e-4 * 8, rtol=2e-5)
        for live in (4, 9):  # one direct tile of the bfloat16 path; two tiles through the paired block
            got = np.asarray(jax.jit(quant_matmul_cpu)(x, w, scales, jnp.int32(live)))
            assert not np.any(got[live:])
            np.testing.assert_allclose(got[:live].astype(np.float64), want[:live], atol=2e-4 * 8, rtol=2e-5)


def _layer_case(rows, inner, cols, bits, groups, x_dtype, vectors_dtype, seed):
    """A quantized layer with zero points and a bias, its vectors held in `vectors_dtype`, and the float64
    product x @ (codes * scales - offsets) + bias of the values as held."""
    x, w, scales, _ = _quant_case(rows, inner, cols, bits, groups, seed)
    rng = np.random.default_rng(seed + 1)
    offsets = jnp.asarray(rng.uniform(-0.3, 0.3, (groups, cols)), vectors_dtype)
    bias = jnp.asarray(rng.uniform(-1, 1, (cols,)), vectors_dtype)
    scales, x = scales.astype(vectors_dtype), x.astype(x_dtype)
    group = np.arange(inner) // (inner // groups)
    held = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
    weights = _unpacked_codes(np.asarray(w), bits) * held(scales)[group] - held(offsets)[group]
    return x, w, scales, offsets, bias, held(x) @ weights + held(bias)


@pytest.mark.parametrize("rows", [1, 2, 7, 13])
@pytest.mark.parametrize("bits, inner, groups", [(8, 512, 1), (8, 640, 5), (4, 512, 4), (4, 768, 3), (4, 256, 16)])
@pytest.mark.parametrize("x_dtype, vectors_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32),
                                                    (jnp.float32, jnp.bfloat16)])
def test_quant_matmul_takes_zero_points_and_bias_and_rounds_once(rows, bits, inner, groups, x_dtype, vectors_dtype):
    """A whole quantized layer in the call: the zero points' part taken from each block's sums (blocks of 256,
    128 and pairs of rows, one group or several per block's span), the bias added, the vectors read as held
    (bfloat16 or float32), and a bfloat16 result rounded once from the same float32 sums as the float32 one."""
    x, w, scales, offsets, bias, want = _layer_case(rows, inner, 320, bits, groups, x_dtype, vectors_dtype,
                                                    rows * 10 + inner + groups)
    layer = lambda out: np.asarray(quant_matmul_cpu(x, w, scales, zero_offsets=offsets, bias=bias, out_dtype=out)
                                   .astype(jnp.float32), np.float64)
    got = layer(jnp.float32)
    np.testing.assert_allclose(got, want, atol=2e-4 * 8, rtol=2e-5)
    rounded = np.asarray(jnp.asarray(got, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(layer(jnp.bfloat16), rounded)


@pytest.mark.parametrize("rows", [1, 2, 13])
@pytest.mark.parametrize("vectors_dtype", [jnp.bfloat16, jnp.float32])
def test_quant_matmul_skips_only_zero_offsets(rows, vectors_dtype):
    """Symmetric schemes' offsets are zeros, and a block whose offsets are all zeros skips their pass: offsets
    zero in some groups and panels but not others still meet every block that has them."""
    x, w, scales, offsets, bias, _ = _layer_case(rows, 512, 320, 4, 4, jnp.bfloat16, vectors_dtype, rows)
    mixed = offsets.at[1:3].set(0).at[:, 64:192].set(0)  # groups 1-2, and panels 1-2 in every group
    held = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
    group = np.arange(512) // 128
    for zero_offsets in (mixed, jnp.zeros_like(offsets)):
        weights = _unpacked_codes(np.asarray(w), 4) * held(scales)[group] - held(zero_offsets)[group]
        want = held(x) @ weights + held(bias)
        got = quant_matmul_cpu(x, w, scales, zero_offsets=zero_offsets, bias=bias)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-4 * 8, rtol=2e-5)


def test_quant_matmul_layer_live_rows_and_portable_build(portable_target):
    """Rows past live stay zeros in a bfloat16 result too, and the portable loops compute the same layer."""
    x, w, scales, offsets, bias, want = _layer_case(13, 256, 128, 4, 2, jnp.bfloat16, jnp.bfloat16, 3)
    kwargs = dict(zero_offsets=offsets, bias=bias, out_dtype=jnp.bfloat16)
    for live in (4, 9):
        got = np.asarray(jax.jit(lambda x, live: quant_matmul_cpu(x, w, scales, live, **kwargs))(x, jnp.int32(live))
                         .astype(jnp.float32), np.float64)
        assert not np.any(got[live:])
        np.testing.assert_allclose(got[:live], want[:live], atol=2e-4 * 8, rtol=2 ** -8)
    target = portable_target.replace("paged_attention_cpu", "quant_matmul_cpu")
    for x_dtype in (jnp.bfloat16, jnp.float32):
        got = quant_matmul_cpu(x.astype(x_dtype), w, scales, _target=target, **kwargs)
        np.testing.assert_allclose(np.asarray(got.astype(jnp.float32), np.float64), want, atol=2e-4 * 8, rtol=2 ** -8)


def _int8_case(rows, inner, cols, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(-128, 128, (rows, inner)).astype(np.int8)
    w = rng.integers(-128, 128, (inner, cols)).astype(np.int8)
    x_scale = rng.uniform(0.001, 0.1, rows).astype(np.float32)
    w_scale = rng.uniform(0.001, 0.1, cols).astype(np.float32)
    want = (x.astype(np.float64) @ w.astype(np.float64)) * x_scale[:, None] * w_scale[None, :]
    return (jnp.asarray(x), jnp.asarray(x_scale), jnp.asarray(w), jnp.asarray(w_scale)), want


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("inner, cols", [(64, 64), (516, 192), (1028, 320)])
def test_int8_matmul_matches_float64(rows, inner, cols):
    """W8A8's integer product: exact int32 sums of the codes (x offset by 128 for vpdpbusd and the offset's
    column sums taken back), then the two scales. 516 and 1028 rows: blocks of 512 with a short last one;
    every column of several panels (the interleaved order transposed back)."""
    args, want = _int8_case(rows, inner, cols, rows + inner + cols)
    got = np.asarray(int8_matmul_cpu(*args), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_int8_matmul_extremes_live_rows_and_the_portable_build(portable_target):
    """Codes of -128 and 127 only (the offset's extremes), rows past live zeros, and the plain loop."""
    x = jnp.asarray(np.where(np.arange(7 * 128).reshape(7, 128) % 3, -128, 127), jnp.int8)
    w = jnp.asarray(np.where(np.arange(128 * 64).reshape(128, 64) % 5, 127, -128), jnp.int8)
    ones_x, ones_w = jnp.ones((7,)), jnp.ones((64,))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_array_equal(np.asarray(int8_matmul_cpu(x, ones_x, w, ones_w), np.float64), want)
    got = np.asarray(jax.jit(int8_matmul_cpu)(x, ones_x, w, ones_w, jnp.int32(3)))
    assert not np.any(got[3:]) and np.array_equal(got[:3], want[:3])
    target = portable_target.replace("paged_attention_cpu", "int8_matmul_cpu")
    args, want = _int8_case(13, 516, 128, 0)
    np.testing.assert_allclose(np.asarray(int8_matmul_cpu(*args, _target=target), np.float64), want, rtol=1e-6,
                               atol=1e-6 * np.abs(want).max())


def test_int8_matmul_refuses_what_it_cannot_do():
    w = jnp.zeros((64, 64), jnp.int8)
    with pytest.raises(ValueError, match="multiple of 4"):
        int8_matmul_cpu(jnp.zeros((2, 62), jnp.int8), jnp.ones((2,)), jnp.zeros((62, 64), jnp.int8), jnp.ones((64,)))
    with pytest.raises(ValueError, match="int8 x"):
        int8_matmul_cpu(jnp.zeros((2, 64)), jnp.ones((2,)), w, jnp.ones((64,)))
    with pytest.raises(ValueError, match="x_scale"):
        int8_matmul_cpu(jnp.zeros((2, 64), jnp.int8), jnp.ones((3,)), w, jnp.ones((64,)))


def _w8a8_case(rows, inner, cols, x_dtype, seed, offsets=True):
    """x with rows of different magnitudes (and an all-zero row, whose scale is float32's epsilon) and the layer's
    float64 result from the library path's quantization of it (activation_codes)."""
    from paged.models.quantization import activation_codes
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, inner)) * rng.uniform(0.01, 30.0, (rows, 1))
    if rows > 2:
        x[1] = 0.0
    x = jnp.asarray(x, x_dtype)
    w = rng.integers(-128, 128, (inner, cols)).astype(np.int8)
    w_scale = rng.uniform(0.001, 0.1, cols).astype(np.float32)
    zero_offsets = rng.uniform(-0.05, 0.05, cols).astype(np.float32) if offsets else None
    codes, x_scale = (np.asarray(v, np.float64) for v in activation_codes(x, "int8"))
    want = (codes @ w.astype(np.float64)) * x_scale * w_scale
    if offsets:
        want -= codes.sum(-1, keepdims=True) * x_scale * zero_offsets
    return (x, jnp.asarray(w), jnp.asarray(w_scale), None if zero_offsets is None else jnp.asarray(zero_offsets)), want


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("rows", [1, 7, 13, 64])
@pytest.mark.parametrize("inner, cols", [(64, 64), (516, 192)])
def test_w8a8_matmul_quantizes_x_as_the_library_path_does(x_dtype, rows, inner, cols):
    """The whole W8A8 layer in one call: x's codes and scales exactly activation_codes' (one code off by one
    moves a result by |w| * scales, hundreds of times the tolerance), the integer product, both scales and the
    zero points. 516 rows: a block of 512 and a short last one, which applies the zero points."""
    args, want = _w8a8_case(rows, inner, cols, x_dtype, rows + inner)
    got = np.asarray(w8a8_matmul_cpu(*args), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_w8a8_matmul_live_rows_no_offsets_and_the_portable_build(portable_target):
    args, want = _w8a8_case(13, 516, 128, jnp.bfloat16, 5)
    got = np.asarray(jax.jit(w8a8_matmul_cpu)(*args, jnp.int32(6)), np.float64)
    assert not np.any(got[6:])
    np.testing.assert_allclose(got[:6], want[:6], rtol=1e-6, atol=1e-6 * np.abs(want).max())
    target = portable_target.replace("paged_attention_cpu", "w8a8_matmul_cpu")
    for x_dtype in (jnp.bfloat16, jnp.float32):
        for offsets in (True, False):
            args, want = _w8a8_case(7, 68, 64, x_dtype, 3, offsets)
            for kwargs in ({}, {"_target": target}):
                got = np.asarray(w8a8_matmul_cpu(*args, **kwargs), np.float64)
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("rows, inner", [(1, 64), (13, 516), (64, 1028)])
def test_w8a8_matmul_adds_the_bias_and_rounds_once(rows, inner, portable_target):
    """The bias added to the float32 sums, and a bfloat16 result the float32 one rounded once (bit for bit),
    natively and in the portable build."""
    args, want = _w8a8_case(rows, inner, 128, jnp.bfloat16, rows)
    bias = np.random.default_rng(rows).uniform(-1.0, 1.0, 128).astype(np.float32)
    want = want + bias
    target = portable_target.replace("paged_attention_cpu", "w8a8_matmul_cpu")
    for kwargs in ({}, {"_target": target}):
        as_f32 = w8a8_matmul_cpu(*args, bias=jnp.asarray(bias), **kwargs)
        np.testing.assert_allclose(np.asarray(as_f32, np.float64), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
        as_bf16 = w8a8_matmul_cpu(*args, bias=jnp.asarray(bias), out_dtype=jnp.bfloat16, **kwargs)
        assert as_bf16.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(as_bf16.astype(jnp.float32)),
                                      np.asarray(as_f32.astype(jnp.bfloat16).astype(jnp.float32)))


def test_w8a8_matmul_refuses_what_it_cannot_do():
    w, scale = jnp.zeros((64, 64), jnp.int8), jnp.ones((64,))
    with pytest.raises(ValueError, match="multiple of 4"):
        w8a8_matmul_cpu(jnp.zeros((2, 62)), jnp.zeros((62, 64), jnp.int8), scale)
    with pytest.raises(ValueError, match="float32 or bfloat16 x"):
        w8a8_matmul_cpu(jnp.zeros((2, 64), jnp.int8), w, scale)
    with pytest.raises(ValueError, match="zero_offsets"):
        w8a8_matmul_cpu(jnp.zeros((2, 64)), w, scale, jnp.ones((32,)))
    with pytest.raises(ValueError, match="bias of 64 values"):
        w8a8_matmul_cpu(jnp.zeros((2, 64)), w, scale, bias=jnp.ones((32,)))
    with pytest.raises(ValueError, match="float32 or bfloat16 result"):
        w8a8_matmul_cpu(jnp.zeros((2, 64)), w, scale, out_dtype=jnp.float16)


def _silu64(g):
    return g / (1.0 + np.exp(-np.clip(g, -700.0, 700.0)))


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows, inner, cols", [(1, 64, 64), (7, 516, 192), (13, 68, 128), (64, 516, 64)])
def test_w8a8_gated_matmul_matches_float64(out_dtype, rows, inner, cols):
    """silu(x @ gate) * (x @ up) in one call, each product as w8a8_matmul_cpu's (x's codes activation_codes'),
    against float64: float32 results to float32's rounding of the exp, bfloat16 ones to one rounding."""
    (x, gate, gate_scale, gate_offsets), g = _w8a8_case(rows, inner, cols, jnp.bfloat16, rows + cols)
    (_, up, up_scale, up_offsets), u = _w8a8_case(rows, inner, cols, jnp.bfloat16, rows + cols)
    rng = np.random.default_rng(rows)  # up: other codes and vectors for the same x
    up = jnp.asarray(rng.integers(-128, 128, (inner, cols)), jnp.int8)
    up_scale = jnp.asarray(rng.uniform(0.001, 0.1, cols), jnp.float32)
    up_offsets = jnp.asarray(rng.uniform(-0.05, 0.05, cols), jnp.float32)
    from paged.models.quantization import activation_codes
    codes, x_scale = (np.asarray(v, np.float64) for v in activation_codes(x, "int8"))
    u = ((codes @ np.asarray(up, np.float64)) * x_scale * np.asarray(up_scale, np.float64)
         - codes.sum(-1, keepdims=True) * x_scale * np.asarray(up_offsets, np.float64))
    want = _silu64(g) * u
    got = w8a8_gated_matmul_cpu(x, gate, gate_scale, gate_offsets, up, up_scale, up_offsets, out_dtype=out_dtype)
    assert got.dtype == out_dtype
    got = np.asarray(got.astype(jnp.float32), np.float64)
    tolerance = 2 ** -8 if out_dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * np.abs(want).max())


def test_w8a8_gated_matmul_live_rows_the_portable_build_and_refusals(portable_target):
    (x, gate, gate_scale, _), g = _w8a8_case(9, 68, 64, jnp.float32, 1, offsets=False)
    (_, up, up_scale, up_offsets), _ = _w8a8_case(9, 68, 64, jnp.float32, 2)
    from paged.models.quantization import activation_codes
    codes, x_scale = (np.asarray(v, np.float64) for v in activation_codes(x, "int8"))
    u = ((codes @ np.asarray(up, np.float64)) * x_scale * np.asarray(up_scale, np.float64)
         - codes.sum(-1, keepdims=True) * x_scale * np.asarray(up_offsets, np.float64))
    want = _silu64(g) * u
    args = (x, gate, gate_scale, None, up, up_scale, up_offsets)
    got = np.asarray(jax.jit(w8a8_gated_matmul_cpu)(*args, jnp.int32(4)), np.float64)
    assert not np.any(got[4:])
    np.testing.assert_allclose(got[:4], want[:4], rtol=1e-5, atol=1e-5 * np.abs(want).max())
    target = portable_target.replace("paged_attention_cpu", "w8a8_gated_matmul_cpu")
    for out_dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2 ** -8)):
        got = w8a8_gated_matmul_cpu(*args, out_dtype=out_dtype, _target=target)
        np.testing.assert_allclose(np.asarray(got.astype(jnp.float32), np.float64), want, rtol=tol,
                                   atol=tol * np.abs(want).max())
    with pytest.raises(ValueError, match="one shape"):
        w8a8_gated_matmul_cpu(x, gate, gate_scale, None, jnp.zeros((68, 128), jnp.int8), jnp.ones((128,)), None)
    with pytest.raises(ValueError, match="float32 or bfloat16 result"):
        w8a8_gated_matmul_cpu(*args, out_dtype=jnp.float16)


def test_pack_for_amx_places_each_int8_code_where_the_tiles_read_it():
    """int8 codes in quads: (p, s, t, i, c, e) holds w[64 s + 4 i + e, 64 p + 16 t + c]; rows past K (100 of
    128) zeros; unpacking inverts."""
    from paged.kernels import cpu as cpu_kernel
    k, n = 100, 128
    w = (np.arange(k * n).reshape(k, n) % 251 - 125).astype(np.int8)
    w[w == 0] = 1  # nonzero, so padding shows
    packed = cpu_kernel.pack_for_amx(w)
    assert packed.dtype == np.int8 and packed.shape == (2, 2, 4096) == cpu_kernel.amx_packed_shape(k, n, np.int8)
    codes = packed.reshape(2, 2, 4, 16, 16, 4)
    for p, s, t, i, c, e in np.ndindex(codes.shape):
        row, col = 64 * s + 4 * i + e, 64 * p + 16 * t + c
        assert codes[p, s, t, i, c, e] == (w[row, col] if row < k else 0)
    np.testing.assert_array_equal(np.asarray(cpu_kernel.pack_for_amx(jnp.asarray(w))), packed)
    np.testing.assert_array_equal(cpu_kernel.unpack_from_amx(packed, k), w)


def _needs_amx_int8():
    from paged.kernels import cpu as cpu_kernel
    if not cpu_kernel.w8a8_on_amx():
        pytest.skip("no AMX-INT8 on this CPU: W8A8 runs on AVX-512 VNNI (tests above)")


def _w8a8_float64(x, w, w_scale, offsets, bias):
    """float64 of what a W8A8 layer computes from activation_codes' codes of x (the library's quantization)."""
    from paged.models.quantization import activation_codes
    codes, row_scale = activation_codes(x, "int8")
    codes, row_scale = np.asarray(codes, np.float64), np.asarray(row_scale, np.float64)
    return (codes @ w.astype(np.float64)) * row_scale * w_scale - codes.sum(-1, keepdims=True) * row_scale * offsets \
        + bias


@pytest.mark.parametrize("rows", [1, 16, 17, 50, 100])
@pytest.mark.parametrize("inner, cols", [(60, 128), (516, 192), (1028, 320), (4100, 640)])
def test_w8a8_on_amx_int8_matches_float64_of_the_codes(rows, inner, cols):
    """x (float32 and bfloat16) quantized per row in the call exactly as activation_codes does (a code off by one
    would move a row by a whole weight's share: far outside float32 rounding), the codes' exact int32 sums, both
    scales, zero points and a bias; one row of zeros (scale eps, codes 0). 60 and 516 inner: a short last tile
    step; 17-100 rows: 32-row blocks and a short one (up to 64 rows panel by panel, the next panel prefetched by
    both blocks from 49), each block of 32 finished a row at a time during the next block's products; 4,100 x
    640: several passes of panels a thread, so a block is finished during the next pass's; 1-16: one A tile. A
    bfloat16 result is the float32 one rounded once."""
    _needs_amx_int8()
    from paged.kernels import cpu as cpu_kernel
    rng = np.random.default_rng(rows + inner + cols)
    w = rng.integers(-128, 128, (inner, cols)).astype(np.int8)
    w_scale, offsets = rng.uniform(0.001, 0.1, cols), rng.uniform(-0.05, 0.05, cols)
    bias = rng.normal(size=cols)
    packed = cpu_kernel.pack_for_amx(jnp.asarray(w))
    vectors = [jnp.asarray(v, jnp.float32) for v in (w_scale, offsets, bias)]
    for dtype in (jnp.float32, jnp.bfloat16):
        # bfloat16 rows divide by a reciprocal and one correction inside 2^-90 <= scale <= 2^100 and truly
        # outside it (amx_int8.cc: quantize_row): rows of both kinds
        x = rng.normal(size=(rows, inner)) * rng.choice([1.0, 50.0, 1e-3, 1e-29, 1e32], size=(rows, 1))
        x[rows // 2] = 0.0
        x = jnp.asarray(x, dtype)
        want = _w8a8_float64(x, w, *(np.asarray(v, np.float64) for v in vectors))
        got = np.asarray(cpu_kernel.w8a8_matmul_packed_cpu(x, packed, *vectors, out_dtype=jnp.float32), np.float64)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
        rounded = cpu_kernel.w8a8_matmul_packed_cpu(x, packed, *vectors, out_dtype=jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(rounded), np.asarray(jnp.asarray(got, jnp.float32).astype(jnp.bfloat16)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_w8a8_on_amx_int8_codes_are_activation_codes(dtype):
    """Every code of x is activation_codes' own, the half-way points included (bfloat16 x lands on them often;
    the reciprocal without its correction step fails here): with weights that sum each 64th code
    of a row into one column, the sums divided by the row's scale are the codes' sums exactly. Rows of every
    scale the kernel treats alike and apart (amx_int8.cc: quantize_row), and a short last step (1,028)."""
    _needs_amx_int8()
    from paged.kernels import cpu as cpu_kernel
    from paged.models.quantization import activation_codes
    rng = np.random.default_rng(0)
    rows, inner = 100, 1028
    x = rng.normal(size=(rows, inner)) * np.geomspace(1e-30, 1e33, rows)[:, None]
    x = jnp.asarray(x, dtype)
    w = (np.arange(inner)[:, None] % 64 == np.arange(64)[None, :]).astype(np.int8)
    codes, scale = activation_codes(x, "int8")
    want = np.asarray(codes, np.int64) @ w.astype(np.int64)
    got = cpu_kernel.w8a8_matmul_packed_cpu(x, cpu_kernel.pack_for_amx(jnp.asarray(w)), jnp.ones(64, jnp.float32),
                                            out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.round(np.asarray(got, np.float64) / np.asarray(scale, np.float64)), want)


@pytest.mark.parametrize("rows, k, n", [(3, 200, 192), (40, 200, 192), (100, 1028, 1088)])
def test_w8a8_gated_on_amx_int8_matches_float64(rows, k, n):
    """silu(x @ gate) * (x @ up) of two W8A8 layers with their own scales and zero points, from one quantization
    of x; float32 sums and activation, against float64 of the same codes; rows past live_rows zeros. 100 rows of
    1,028 x 1,088: 32-row blocks finished during the next block's products, across passes of panels."""
    _needs_amx_int8()
    from paged.kernels import cpu as cpu_kernel
    rng = np.random.default_rng(rows)
    layers = []
    for _ in "gu":
        w = rng.integers(-128, 128, (k, n)).astype(np.int8)
        layers.append((w, rng.uniform(0.0005, 0.002, n), rng.uniform(-0.01, 0.01, n)))
    x = jnp.asarray(rng.normal(size=(rows, k)), jnp.float32)
    (g, u) = (_w8a8_float64(x, w, scale, offsets, 0.0) for w, scale, offsets in layers)
    want = g / (1 + np.exp(-g)) * u
    args = [a for w, scale, offsets in layers
            for a in (cpu_kernel.pack_for_amx(jnp.asarray(w)), jnp.asarray(scale, jnp.float32),
                      jnp.asarray(offsets, jnp.float32))]
    got = np.asarray(jax.jit(cpu_kernel.w8a8_gated_matmul_packed_cpu)(x, *args, jnp.int32(rows - 1)), np.float64)
    np.testing.assert_allclose(got[:-1], want[:-1], rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not np.any(got[-1])


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 100])
@pytest.mark.parametrize("inner, cols", [(60, 128), (1028, 320), (1024, 192)])
@pytest.mark.parametrize("zero_points", [True, False], ids=["zero-points", "symmetric"])
def test_int8_weights_on_amx_match_float64(rows, inner, cols, zero_points):
    """Weight-only int8 on AMX: bfloat16 x as it is against the codes widened to bfloat16 (exact), float32 sums,
    then the column scales, the zero points against x's row sums (symmetric codes: none, and x's row sums are
    not taken), and the bias; rows past live_rows zeros. Where K is a multiple of 64, x is read in place but
    for a short last block."""
    _needs_amx_int8()
    from paged.kernels import cpu as cpu_kernel
    if not cpu_kernel.int8_weights_on_amx():
        pytest.skip("no AVX-512 BF16 beside the tiles")
    rng = np.random.default_rng(rows + inner)
    w = rng.integers(-128, 128, (inner, cols)).astype(np.int8)
    w_scale, offsets, bias = rng.uniform(0.001, 0.1, cols), rng.uniform(-0.05, 0.05, cols), rng.normal(size=cols)
    x = jnp.asarray(rng.normal(size=(rows, inner)), jnp.bfloat16)
    x64 = np.asarray(x, np.float64)
    want = (x64 @ w.astype(np.float64)) * w_scale + bias
    if zero_points:
        want -= x64.sum(-1, keepdims=True) * offsets
    vectors = [None if v is None else jnp.asarray(v, jnp.float32)
               for v in (w_scale, offsets if zero_points else None, bias)]
    live = max(rows - 1, 1)
    got = np.asarray(jax.jit(lambda x, p, *v: cpu_kernel.int8_weights_matmul_packed_cpu(
        x, p, *v, live_rows=jnp.int32(live), out_dtype=jnp.float32))(x, cpu_kernel.pack_for_amx(jnp.asarray(w)),
                                                                      *vectors), np.float64)
    np.testing.assert_allclose(got[:live], want[:live], rtol=2e-6, atol=2e-6 * np.abs(want).max())
    assert not np.any(got[live:])
    with pytest.raises(ValueError, match="bfloat16 x"):
        cpu_kernel.int8_weights_matmul_packed_cpu(x.astype(jnp.float32), cpu_kernel.pack_for_amx(jnp.asarray(w)),
                                                  vectors[0])


@pytest.mark.parametrize("rows", [9, 40, 100])
def test_int8_weights_gated_on_amx_matches_float64(rows):
    """silu(x @ gate) * (x @ up) of two weight-only int8 layers (gate with zero points, up symmetric) in one
    call: digits up to 16 rows, the codes widened beyond, over 64 rows two panels at a time with K in chunks
    (K = 1028: 33 bf16 steps, the last chunk short; 5 panels, so a thread's last may be alone); float32 out
    against float64."""
    _needs_amx_int8()
    from paged.kernels import cpu as cpu_kernel
    if not cpu_kernel.int8_weights_on_amx():
        pytest.skip("no AVX-512 BF16 beside the tiles")
    rng = np.random.default_rng(rows)
    inner, cols = 1028, 320
    x = jnp.asarray(rng.normal(size=(rows, inner)), jnp.bfloat16)
    x64 = np.asarray(x, np.float64)
    layers, products = [], []
    for offsets in (rng.uniform(-0.05, 0.05, cols), None):
        w = rng.integers(-128, 128, (inner, cols)).astype(np.int8)
        scale = rng.uniform(0.0005, 0.002, cols)
        product = (x64 @ w.astype(np.float64)) * scale
        if offsets is not None:
            product -= x64.sum(-1, keepdims=True) * offsets
        products.append(product)
        layers += [cpu_kernel.pack_for_amx(jnp.asarray(w)), jnp.asarray(scale, jnp.float32),
                   None if offsets is None else jnp.asarray(offsets, jnp.float32)]
    g, u = products
    want = g / (1 + np.exp(-g)) * u
    got = np.asarray(jax.jit(lambda x, *a: cpu_kernel.w8a8_gated_matmul_packed_cpu(
        x, *a, out_dtype=jnp.float32, weight_only=True))(x, *layers), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("rows", [1, 4, 5, 10, 16])
def test_int8_weights_on_amx_decode_steps_keep_float32_accuracy(rows):
    """Decode-sized steps write x as four int8 digits per element against the codes on the int8 tiles: each row
    of the result matches float64 to better than a float32 product does, with a massive activation beside small
    ones and a row of zeros; a row so small that its last digit's scale leaves float32's normal range keeps
    three."""
    _needs_amx_int8()
    from paged.kernels import cpu as cpu_kernel
    if not cpu_kernel.int8_weights_on_amx():
        pytest.skip("no AVX-512 BF16 beside the tiles")
    rng = np.random.default_rng(rows)
    inner, cols = 1100, 192
    w = rng.integers(-128, 128, (inner, cols)).astype(np.int8)
    w_scale = rng.uniform(0.001, 0.01, cols)
    x = rng.normal(size=(rows, inner))
    x[:, 7], x[:, 100] = 3000.0, -5e-4
    x[rows // 2] = 0.0
    x[-1] *= 1e-33 if rows > 1 else 1.0  # its fourth scale, max|x| / (127 * 254^3), is below FLT_MIN
    x = jnp.asarray(x, jnp.bfloat16)
    x64 = np.asarray(x, np.float64)
    want = (x64 @ w.astype(np.float64)) * w_scale
    got = np.asarray(jax.jit(lambda x, p, s: cpu_kernel.int8_weights_matmul_packed_cpu(x, p, s, out_dtype=jnp.float32))(
        x, cpu_kernel.pack_for_amx(jnp.asarray(w)), jnp.asarray(w_scale, jnp.float32)), np.float64)
    float32 = (np.asarray(x, np.float32) @ w.astype(np.float32)).astype(np.float64) * w_scale
    for row in range(rows):
        peak = np.abs(want[row]).max()
        if peak == 0:
            assert not np.any(got[row])
            continue
        error = np.abs(got[row] - want[row]).max() / peak
        if rows > 1 and row == rows - 1:  # three digits: a grid of max|x| / (127 * 254^2)
            assert error < 1e-5, error
        else:
            assert error < max(2e-7, np.abs(float32[row] - want[row]).max() / peak), (row, error)


def _needs_int4_on_amx():
    from paged.kernels import cpu as cpu_kernel
    if not cpu_kernel.int4_on_amx():
        pytest.skip("no AMX-INT8 with AVX-512 BF16 on this CPU: int4 layers keep the AVX-512 kernel")


def _int4_layer(rng, inner, cols, groups, offsets=True, bfloat16=False):
    """Random int4 codes as the layers hold them ([K / 2, N] uint8, row 2i low nibble), group scales and zero
    offsets, and the float64 kernel they stand for: (u - 8) * scale - offset; with `bfloat16`, that kernel as the
    prompt-sized walk holds it: u * scale - (8 scale + offset) in float32, rounded to bfloat16."""
    qweight = rng.integers(0, 256, (inner // 2, cols)).astype(np.uint8)
    codes = np.stack([qweight & 0xF, qweight >> 4], axis=1).reshape(inner, cols).astype(np.float64)
    scales = rng.uniform(0.001, 0.02, (groups, cols)).astype(np.float32).astype(np.float64)
    zero_offsets = (rng.uniform(-0.01, 0.01, (groups, cols)) if offsets else np.zeros((groups, cols))
                    ).astype(np.float32).astype(np.float64)
    grouped = codes.reshape(groups, inner // groups, cols)
    if bfloat16:  # float64 holds each float32 step exactly, so one rounding each, as the kernel's fma
        shift = (8 * scales + zero_offsets).astype(np.float32).astype(np.float64)
        w32 = (grouped * scales[:, None] - shift[:, None]).astype(np.float32)
        w = w32.astype(jnp.bfloat16).astype(np.float64).reshape(inner, cols)
    else:
        w = ((grouped - 8) * scales[:, None] - zero_offsets[:, None]).reshape(inner, cols)
    return qweight, scales, zero_offsets if offsets else None, w


@pytest.mark.parametrize("inner, cols", [(256, 128), (200, 64), (1100, 192)])
def test_int4_packing_for_amx_round_trips(inner, cols):
    """pack_int4_for_amx folds the int8 layout's 4 KB steps into 2 KB (code j low nibble, j + 2048 high), and
    unpack_int4_from_amx gives the codes back; numpy and jax agree."""
    from paged.kernels import cpu as cpu_kernel
    rng = np.random.default_rng(inner)
    qweight = rng.integers(0, 256, (-(-inner // 2), cols)).astype(np.uint8)
    packed = cpu_kernel.pack_int4_for_amx(qweight)
    assert packed.shape == cpu_kernel.amx_int4_packed_shape(2 * qweight.shape[0], cols) and packed.dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(cpu_kernel.pack_int4_for_amx(jnp.asarray(qweight))), packed)
    np.testing.assert_array_equal(cpu_kernel.unpack_int4_from_amx(packed, 2 * qweight.shape[0]), qweight)
    codes = np.stack([qweight & 0xF, qweight >> 4], axis=1).reshape(-1, cols).astype(np.int8)
    steps = np.asarray(cpu_kernel.pack_for_amx(codes))  # [panels, steps, 4096]
    np.testing.assert_array_equal(packed & 0xF, steps[..., :2048])
    np.testing.assert_array_equal(packed >> 4, steps[..., 2048:])


@pytest.mark.parametrize("rows", [1, 4, 5, 6, 12, 16, 17, 18, 40, 65, 66, 100])
@pytest.mark.parametrize("inner, cols, groups", [(256, 128, 2), (640, 192, 5), (200, 64, 1), (1024, 128, 16)])
def test_int4_on_amx_matches_float64(rows, inner, cols, groups):
    """Weight-only int4 on AMX, group by group, the group scales, zero offsets (against the group's sums of x)
    and bias in float32. Up to 4 rows on the int8 tiles (x as digits against the codes), 5 to 64 on the bf16
    tiles, 16 rows at a time (x against the codes as exact bfloat16 values): float64 of x @ ((u - 8) * scale -
    offset) + bias, closer than a float32 product. Beyond, on the bf16 tiles against the weights dequantized to
    bfloat16: float64 of x @ those, to float32 sums' accuracy. Rows past live_rows zeros."""
    _needs_int4_on_amx()
    from paged.kernels import cpu as cpu_kernel
    rng = np.random.default_rng(rows * inner)
    live = max(rows - 1, 1)  # the rows the call computes
    qweight, scales, offsets, w = _int4_layer(rng, inner, cols, groups, bfloat16=live > 64)
    bias = rng.normal(size=cols)
    x = jnp.asarray(rng.normal(size=(rows, inner)), jnp.bfloat16)
    x64 = np.asarray(x, np.float64)
    want = x64 @ w + bias
    got = np.asarray(jax.jit(lambda x, p, *v: cpu_kernel.int4_matmul_packed_cpu(
        x, p, *v, live_rows=jnp.int32(live), out_dtype=jnp.float32))(
            x, jnp.asarray(cpu_kernel.pack_int4_for_amx(qweight)), *(jnp.asarray(v, jnp.float32)
                                                                      for v in (scales, offsets, bias))), np.float64)
    float32 = np.asarray(x, np.float32) @ w.astype(np.float32) + bias.astype(np.float32)
    error = np.abs(got[:live] - want[:live]).max() / np.abs(want).max()
    assert error < max(2e-7, np.abs(float32[:live] - want[:live]).max() / np.abs(want).max()), error
    assert not np.any(got[live:])


@pytest.mark.parametrize("rows", [1, 9, 40, 100])
def test_int4_gated_on_amx_and_defaults(rows):
    """The gated call: silu(x @ gate) * (x @ up) of two int4 layers in the same groups, one with zero offsets and
    one symmetric (none), rounded once to bfloat16 by default (over 64 rows two panels at a time, K in chunks:
    5 panels); layers in different groups are refused."""
    _needs_int4_on_amx()
    from paged.kernels import cpu as cpu_kernel
    rng = np.random.default_rng(rows)
    inner, cols = 384, 320
    (qg, sg, og, wg), (qu, su, _, wu) = _int4_layer(rng, inner, cols, 3), _int4_layer(rng, inner, cols, 3, False)
    x = jnp.asarray(rng.normal(size=(rows, inner)), jnp.bfloat16)
    g, u = np.asarray(x, np.float64) @ wg, np.asarray(x, np.float64) @ wu
    want = g / (1 + np.exp(-g)) * u
    got = jax.jit(cpu_kernel.int4_gated_matmul_packed_cpu)(
        x, jnp.asarray(cpu_kernel.pack_int4_for_amx(qg)), jnp.asarray(sg, jnp.float32), jnp.asarray(og, jnp.float32),
        jnp.asarray(cpu_kernel.pack_int4_for_amx(qu)), jnp.asarray(su, jnp.float32), None)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=8e-3, atol=8e-3 * np.abs(want).max())
    with pytest.raises(ValueError, match="same groups"):
        cpu_kernel.int4_gated_matmul_packed_cpu(x, jnp.asarray(cpu_kernel.pack_int4_for_amx(qg)), jnp.ones((3, cols)),
                                                None, jnp.asarray(cpu_kernel.pack_int4_for_amx(qu)),
                                                jnp.ones((1, cols)), None)


def test_int4_on_amx_refuses_what_it_cannot_do():
    _needs_int4_on_amx()
    from paged.kernels import cpu as cpu_kernel
    packed = jnp.asarray(cpu_kernel.pack_int4_for_amx(np.zeros((96, 64), np.uint8)))  # K = 192
    x, scales = jnp.zeros((2, 192), jnp.bfloat16), jnp.ones((3, 64))
    with pytest.raises(ValueError, match="bfloat16 x"):
        cpu_kernel.int4_matmul_packed_cpu(x.astype(jnp.float32), packed, scales)
    with pytest.raises(ValueError, match="packed"):
        cpu_kernel.int4_matmul_packed_cpu(jnp.zeros((2, 256), jnp.bfloat16), packed, scales)
    with pytest.raises(ValueError, match="multiple of 64"):
        cpu_kernel.int4_matmul_packed_cpu(x, packed, jnp.ones((2, 64)))  # groups of 96 rows
    with pytest.raises(ValueError, match="zero_offsets"):
        cpu_kernel.int4_matmul_packed_cpu(x, packed, scales, jnp.ones((1, 64)))
    with pytest.raises(ValueError, match="bias"):
        cpu_kernel.int4_matmul_packed_cpu(x, packed, scales, None, jnp.ones(32))


def test_w8a8_on_amx_int8_live_rows_extremes_and_defaults():
    """Rows past live_rows come back zeros (and are not read); codes of -128 and 127 at every position (x's
    largest magnitude sits at +-127.5 scale units: 127.5 rounds half to even to 128 and is clipped, -127.5 to
    -128); no offsets or bias, and the result in x's dtype by default."""
    _needs_amx_int8()
    from paged.kernels import cpu as cpu_kernel
    rng = np.random.default_rng(0)
    w = np.where(np.arange(128 * 64).reshape(128, 64) % 5, 127, -128).astype(np.int8)
    x = np.where(np.arange(40 * 128).reshape(40, 128) % 3, -1.0, 1.0) * rng.choice([1.0, 3.0], size=(40, 1))
    w_scale = jnp.asarray(rng.uniform(0.5, 2.0, 64), jnp.float32)
    packed = cpu_kernel.pack_for_amx(jnp.asarray(w))
    for dtype in (jnp.float32, jnp.bfloat16):  # bfloat16 x finds its peak from the bits (amx_int8.cc: row_peak)
        x = jnp.asarray(x, dtype)
        want = _w8a8_float64(x, w, np.asarray(w_scale, np.float64), 0.0, 0.0)
        got = jax.jit(lambda x, p, s, live: cpu_kernel.w8a8_matmul_packed_cpu(x, p, s, live_rows=live,
                                                                              out_dtype=jnp.float32))(
            x, packed, w_scale, jnp.int32(37))
        assert not np.any(np.asarray(got[37:]))
        np.testing.assert_allclose(np.asarray(got[:37], np.float64), want[:37], rtol=1e-6)
        assert cpu_kernel.w8a8_matmul_packed_cpu(x, packed, w_scale).dtype == dtype


def test_w8a8_on_amx_int8_refuses_what_it_cannot_do():
    _needs_amx_int8()
    from paged.kernels import cpu as cpu_kernel
    packed = cpu_kernel.pack_for_amx(jnp.zeros((64, 128), jnp.int8))
    ones = jnp.ones((128,))
    with pytest.raises(ValueError, match="packed"):
        cpu_kernel.w8a8_matmul_packed_cpu(jnp.zeros((4, 130)), packed, ones)  # packed for K up to 64
    with pytest.raises(ValueError, match="packed"):
        cpu_kernel.w8a8_matmul_packed_cpu(jnp.zeros((4, 64)), cpu_kernel.pack_for_amx(jnp.zeros((64, 128), jnp.bfloat16)), ones)
    with pytest.raises(ValueError, match="float32 or bfloat16 x"):
        cpu_kernel.w8a8_matmul_packed_cpu(jnp.zeros((4, 64), jnp.int8), packed, ones)
    with pytest.raises(ValueError, match="w_scale of 128"):
        cpu_kernel.w8a8_matmul_packed_cpu(jnp.zeros((4, 64)), packed, jnp.ones((64,)))
    with pytest.raises(ValueError, match="bias of 128"):
        cpu_kernel.w8a8_matmul_packed_cpu(jnp.zeros((4, 64)), packed, ones, bias=jnp.ones((3,)))


def test_quant_matmul_refuses_what_it_cannot_do():
    x = jnp.zeros((4, 96))
    with pytest.raises(ValueError, match="do not fit"):  # 96 / 4 = 24-row groups
        quant_matmul_cpu(x, jnp.zeros((96, 64), jnp.int8), jnp.zeros((4, 64)))
    with pytest.raises(ValueError, match="do not fit"):
        quant_matmul_cpu(jnp.zeros((4, 128)), jnp.zeros((128, 64), jnp.uint8), jnp.zeros((1, 64)))  # not K / 2
    with pytest.raises(ValueError, match="float32 or bfloat16 x"):
        quant_matmul_cpu(jnp.zeros((4, 128), jnp.float16), jnp.zeros((128, 64), jnp.int8), jnp.zeros((1, 64)))
    with pytest.raises(ValueError, match="even number of rows per group"):  # bfloat16 multiplies k pairs
        quant_matmul_cpu(jnp.zeros((4, 128), jnp.bfloat16), jnp.zeros((128, 64), jnp.int8), jnp.zeros((128, 64)))
    w, scales = jnp.zeros((128, 64), jnp.int8), jnp.zeros((2, 64))
    with pytest.raises(ValueError, match="zero_offsets shaped as the scales"):
        quant_matmul_cpu(jnp.zeros((4, 128)), w, scales, zero_offsets=jnp.zeros((1, 64)))
    with pytest.raises(ValueError, match="bias of 64 values"):
        quant_matmul_cpu(jnp.zeros((4, 128)), w, scales, bias=jnp.zeros((32,)))
    with pytest.raises(ValueError, match="out_dtype must be float32 or bfloat16"):
        quant_matmul_cpu(jnp.zeros((4, 128)), w, scales, out_dtype=jnp.float16)


def test_matmul_bfloat16_live_rows():
    x, w, want = _bf16_case(20, 200, 128, 1)
    got = np.asarray(jax.jit(matmul_cpu)(x, w, jnp.int32(9)))
    assert not np.any(got[9:])
    np.testing.assert_allclose(got[:9].astype(np.float64), want[:9], atol=2e-4, rtol=2e-5)


@pytest.mark.parametrize("live", [0, 1, 7, 40, 47, 48, 100])
def test_matmul_live_rows(live):
    """Rows from live_rows on are zeros (the input there holds garbage, NaN included); the rows before are
    the float64 product and bit for bit what the whole product gives them. A traced count (as in the jitted
    step) and counts past M behave the same."""
    rng = np.random.default_rng(live)
    x = rng.normal(size=(48, 200)).astype(np.float32)
    x[live:] = np.nan
    w = rng.normal(size=(200, 192)).astype(np.float32)
    got = np.asarray(jax.jit(matmul_cpu)(jnp.asarray(x), jnp.asarray(w), jnp.int32(live)))
    n = min(live, 48)
    assert not np.any(got[n:])
    np.testing.assert_allclose(got[:n].astype(np.float64), x[:n].astype(np.float64) @ w.astype(np.float64),
                               atol=2e-4, rtol=2e-5)
    whole = np.asarray(matmul_cpu(jnp.asarray(np.nan_to_num(x)), jnp.asarray(w)))
    np.testing.assert_array_equal(got[:n], whole[:n])


def test_matmul_fast_path_follows_the_cpu():
    """The AVX-512 matmul is built (and used by the model) exactly when the CPU has AVX-512, the bfloat16 one
    exactly when it has AVX-512 BF16, on AMX tiles (and then for every row count) exactly when it has AMX-BF16;
    bfloat16 prompt attention runs on AMX tiles exactly when it has both."""
    from pathlib import Path

    from paged.kernels import cpu as cpu_kernel
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to compare with")
    assert available()[0]
    flags = cpuinfo.read_text().replace("\n", " ")
    assert cpu_kernel.matmul_is_vectorized("float32") == (" avx512f " in flags)
    assert cpu_kernel.matmul_is_vectorized("bfloat16") == (" avx512_bf16 " in flags)
    assert cpu_kernel.matmul_is_vectorized("int8") == (" avx512f " in flags)
    assert cpu_kernel.matmul_on_amx() == (" amx_bf16 " in flags)  # Linux grants the tile state (kernel >= 5.16)
    assert cpu_kernel.prompt_attention_on_amx() == (" amx_bf16 " in flags and " avx512_bf16 " in flags)
    assert cpu_kernel.matmul_max_rows("bfloat16") == (2**31 - 1 if " amx_bf16 " in flags else 256 * (
        " avx512_bf16 " in flags))


def test_matmul_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="multiple of 64"):
        matmul_cpu(jnp.zeros((4, 8)), jnp.zeros((8, 100)))
    with pytest.raises(ValueError, match="even K"):
        matmul_cpu(jnp.zeros((4, 7), jnp.bfloat16), jnp.zeros((7, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match="two float32 or two bfloat16"):
        matmul_cpu(jnp.zeros((4, 8), jnp.bfloat16), jnp.zeros((8, 64)))
    with pytest.raises(ValueError, match="two float32 or two bfloat16"):
        matmul_cpu(jnp.zeros((4, 8)), jnp.zeros((8, 64), jnp.int8))  # int8 weights: quant_matmul_cpu
    with pytest.raises(ValueError, match="live_rows must be an integer scalar"):
        matmul_cpu(jnp.zeros((4, 8)), jnp.zeros((8, 64)), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="live_rows must be an integer scalar"):
        matmul_cpu(jnp.zeros((4, 8)), jnp.zeros((8, 64)), 2.5)

