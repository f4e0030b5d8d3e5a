"""The XLA paged attentions (reference and chunked) against a float64 numpy loop over plain (unpaged) K/V."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged.kernels import (packed_causal_attention, paged_attention_chunked, paged_attention_reference,
                           write_kv_to_cache)

IMPLEMENTATIONS = pytest.mark.parametrize("attention", [paged_attention_reference, paged_attention_chunked],
                                          ids=["reference", "chunked"])


def numpy_attention(q, k, v, scale, window=None):
    """q [T, Hq, D] at positions 0..T-1 of one sequence; k, v [T, Hkv, D]; float64 causal softmax."""
    t_len, hq, _ = q.shape
    group = hq // k.shape[1]
    out = np.zeros(q.shape, np.float64)
    for t in range(t_len):
        lo = 0 if window is None else max(0, t - window + 1)
        for h in range(hq):
            s = k[lo:t + 1, h // group].astype(np.float64) @ q[t, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v[lo:t + 1, h // group].astype(np.float64)
    return out


@IMPLEMENTATIONS
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_float64_on_random_pages(attention, block_size, num_q_heads, num_kv_heads, head_dim):
    rng = np.random.default_rng(block_size * 100 + num_q_heads * 10 + num_kv_heads + head_dim)
    num_layers, num_blocks, pages_per_seq = 2, 40, 9
    # Lengths 1, one page, a partial page, and the full table; the table is wider than most need.
    lengths = [1, block_size, 2 * block_size + 3, pages_per_seq * block_size]
    pool = [rng.normal(size=(num_layers, num_kv_heads, num_blocks, block_size, head_dim)).astype(np.float32)
            for _ in range(2)]
    k_cache, v_cache = jnp.asarray(pool[0]), jnp.asarray(pool[1])
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(lengths), pages_per_seq), np.int32)
    qs, ks, vs, seq_ids, positions, slots = [], [], [], [], [], []
    for s, n in enumerate(lengths):
        pages = perm[s * pages_per_seq:(s + 1) * pages_per_seq]
        tables[s] = pages
        ks.append(rng.normal(size=(n, num_kv_heads, head_dim)).astype(np.float32))
        vs.append(rng.normal(size=(n, num_kv_heads, head_dim)).astype(np.float32))
        qs.append(rng.normal(size=(n, num_q_heads, head_dim)).astype(np.float32))
        seq_ids += [s] * n
        positions += list(range(n))
        slots += [pages[i // block_size] * block_size + i % block_size for i in range(n)]
    layer = 1
    k_cache, v_cache = write_kv_to_cache(k_cache, v_cache, layer, jnp.asarray(np.concatenate(ks)),
                                         jnp.asarray(np.concatenate(vs)), jnp.asarray(slots, jnp.int32))
    scale = head_dim ** -0.5
    out = np.asarray(attention(
        jnp.asarray(np.concatenate(qs)), k_cache, v_cache, layer, jnp.asarray(tables),
        jnp.asarray(seq_ids, jnp.int32), jnp.asarray(positions, jnp.int32), scale=scale))
    want = np.concatenate([numpy_attention(q, k, v, scale) for q, k, v in zip(qs, ks, vs)])
    assert np.isfinite(out).all()
    # float32 end to end over <= 192 keys: errors stay near 1e-6; 1e-4 leaves room for summation order.
    np.testing.assert_allclose(out, want, atol=1e-4, rtol=1e-4)
    # The other layer was not touched.
    np.testing.assert_array_equal(np.asarray(k_cache[0]), pool[0][0])


@IMPLEMENTATIONS
def test_sliding_window_and_bfloat16(attention):
    rng = np.random.default_rng(0)
    n, hq, hkv, d, bs, window = 40, 4, 2, 64, 8, 13
    k = rng.normal(size=(n, hkv, d)).astype(np.float32)
    v = rng.normal(size=(n, hkv, d)).astype(np.float32)
    q = rng.normal(size=(n, hq, d)).astype(np.float32)
    pages = np.array([3, 9, 1, 7, 5], np.int32)
    slots = jnp.asarray([pages[i // bs] * bs + i % bs for i in range(n)], jnp.int32)
    for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 5e-2)):
        cache = jnp.zeros((1, hkv, 10, bs, d), dtype)
        kc, vc = write_kv_to_cache(cache, cache, 0, jnp.asarray(k, dtype), jnp.asarray(v, dtype), slots)
        out = attention(jnp.asarray(q, dtype), kc, vc, 0, jnp.asarray(pages[None]),
                                        jnp.zeros(n, jnp.int32), jnp.arange(n, dtype=jnp.int32),
                                        scale=d ** -0.5, sliding_window=window)
        # bf16 inputs carry 8 mantissa bits (rel. error ~4e-3 per element); outputs are convex mixes of
        # O(1) values, so 5e-2 absolute bounds the rounding of q, k, v, probabilities and output.
        want = numpy_attention(np.asarray(jnp.asarray(q, dtype).astype(jnp.float32)),
                               np.asarray(jnp.asarray(k, dtype).astype(jnp.float32)),
                               np.asarray(jnp.asarray(v, dtype).astype(jnp.float32)), d ** -0.5, window)
        np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 7])
def test_packed_causal_attention_with_one_cached_prefix(window):
    """Fresh prompt A and prompt B continuing after 21 cached tokens, packed together: float64 reference."""
    rng = np.random.default_rng(7)
    hq, hkv, d, bs = 4, 2, 16, 8
    cached_b, new_a, new_b = 21, 9, 12
    total_b = cached_b + new_b
    ka, va = rng.normal(size=(2, new_a, hkv, d)).astype(np.float32)
    kb, vb = rng.normal(size=(2, total_b, hkv, d)).astype(np.float32)
    qa = rng.normal(size=(new_a, hq, d)).astype(np.float32)
    qb = rng.normal(size=(new_b, hq, d)).astype(np.float32)
    pages_b = np.array([6, 2, 9, 4, 0], np.int32)  # 33 tokens in 5 pages; the last entry is padding
    cache = np.zeros((1, hkv, 12, bs, d), np.float32)
    k_cache, v_cache = cache.copy(), cache.copy()
    for i in range(cached_b):  # only B's prefix is in the pool; the new tokens come in as k, v
        k_cache[0, :, pages_b[i // bs], i % bs] = kb[i]
        v_cache[0, :, pages_b[i // bs], i % bs] = vb[i]
    q = np.concatenate([qa, qb])
    k = np.concatenate([ka, kb[cached_b:]])
    v = np.concatenate([va, vb[cached_b:]])
    seq = np.array([0] * new_a + [1] * new_b, np.int32)
    pos = np.array(list(range(new_a)) + list(range(cached_b, total_b)), np.int32)
    tables = np.stack([np.zeros(5, np.int32), pages_b])
    out = np.asarray(packed_causal_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(seq), jnp.asarray(pos), scale=d ** -0.5,
        sliding_window=window, k_cache=jnp.asarray(k_cache), v_cache=jnp.asarray(v_cache), layer=0,
        prefix_page_row=jnp.asarray(tables[1]), prefix_seq_id=1, prefix_len=cached_b))
    want_a = numpy_attention(qa, ka, va, d ** -0.5, window)
    want_b = numpy_attention(np.concatenate([np.zeros((cached_b, hq, d), np.float32), qb]), kb, vb, d ** -0.5,
                             window)[cached_b:]
    np.testing.assert_allclose(out, np.concatenate([want_a, want_b]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 1, 70, 200])
def test_chunked_matches_reference_on_long_mixed_contexts(window):
    """Many rows (length-sorted groups) and contexts of several chunks, where a window lets rows skip the
    chunks behind it; the window is traced, as in the engine's layer scan."""
    rng = np.random.default_rng(window)
    num_seqs, pages_per_seq, bs, hkv, hq, d = 40, 24, 16, 2, 8, 64
    shape = (2, hkv, num_seqs * pages_per_seq + 1, bs, d)
    k_cache = jnp.asarray(rng.normal(size=shape).astype(np.float32))
    v_cache = jnp.asarray(rng.normal(size=shape).astype(np.float32))
    tables = jnp.asarray(rng.permutation(np.arange(1, shape[2])).reshape(num_seqs, pages_per_seq), jnp.int32)
    positions = jnp.asarray(rng.integers(0, pages_per_seq * bs, size=num_seqs), jnp.int32)
    q = jnp.asarray(rng.normal(size=(num_seqs, hq, d)).astype(np.float32))
    rows = jnp.arange(num_seqs, dtype=jnp.int32)
    args = (q, k_cache, v_cache, 1, tables, rows, positions)
    got = jax.jit(lambda w: paged_attention_chunked(*args, scale=0.125, sliding_window=w))(jnp.int32(window))
    want = paged_attention_reference(*args, scale=0.125, sliding_window=window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
