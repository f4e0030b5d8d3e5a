"""float8 KV pools (kv_cache_dtype="fp8"): writes round and saturate as ml_dtypes does, and every kernel reads
the pool as the float64 values of its fp8 codes."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from paged.kernels import (cpu, paged_attention_chunked, paged_attention_reference, paged_decode_attention,
                           ragged_paged_attention, write_kv_to_cache)
from tests.pallas_kernels.kernel_inputs import attention_f64

E4M3 = ml_dtypes.float8_e4m3fn


def _writers():
    yield "xla", write_kv_to_cache
    if cpu.available()[0]:
        yield "native", cpu.write_kv_cpu


@pytest.mark.parametrize("name, write", list(_writers()), ids=[n for n, _ in _writers()])
@pytest.mark.parametrize("fmt", [E4M3, ml_dtypes.float8_e5m2], ids=["e4m3", "e5m2"])
def test_writes_round_to_nearest_and_saturate(name, write, fmt):
    rng = np.random.default_rng(0)
    k = rng.normal(size=(6, 2, 16)).astype(np.float32) * 3
    k[0, 0, :4] = [1000.0, -1000.0, 448.0, 1e5]  # beyond e4m3's 448 (and e5m2's 57344 for the last)
    v = rng.normal(size=(6, 2, 16)).astype(np.float32)
    pool = jnp.zeros((2, 2, 4, 4, 16), fmt)
    slots = jnp.asarray([5, 6, 7, 12, 13, 1], jnp.int32)
    k_pool, v_pool = write(pool, pool, 1, jnp.asarray(k), jnp.asarray(v), slots)
    limit = float(ml_dtypes.finfo(fmt).max)
    want = np.clip(k, -limit, limit).astype(fmt)  # ml_dtypes: round to nearest even
    got = np.asarray(k_pool)[1].transpose(1, 2, 0, 3).reshape(16, 2, 16)[np.asarray(slots)]
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    assert np.isfinite(got.astype(np.float32)).all()
    np.testing.assert_array_equal(np.asarray(v_pool)[1].transpose(1, 2, 0, 3).reshape(16, 2, 16)[np.asarray(slots)]
                                  .view(np.uint8), v.astype(fmt).view(np.uint8))
    assert not np.asarray(k_pool)[0].astype(np.float32).any()  # the other layer untouched


def _fp8_case(seed=0, block_size=8, num_q_heads=8, num_kv_heads=2, head_dim=64):
    """A pool of random fp8 codes, four sequences (lengths 1, a page, a partial page, the whole table)."""
    rng = np.random.default_rng(seed)
    num_blocks, pages_per_seq = 40, 6
    shape = (2, num_kv_heads, num_blocks, block_size, head_dim)
    k_pool = rng.normal(size=shape).astype(E4M3)
    v_pool = rng.normal(size=shape).astype(E4M3)
    tables = rng.permutation(np.arange(1, num_blocks))[:4 * pages_per_seq].reshape(4, pages_per_seq).astype(np.int32)
    lengths = np.array([1, block_size, 2 * block_size + 3, pages_per_seq * block_size], np.int32)
    return rng, k_pool, v_pool, tables, lengths


def _kv_f64(pool, tables, seq, length):
    """Per KV head, the first `length` keys of a sequence as float64 [length, D]: the fp8 codes' values."""
    layer = pool[1]
    return [layer[h, tables[seq]].reshape(-1, layer.shape[-1])[:length].astype(np.float64)
            for h in range(layer.shape[0])]


def test_prefill_kernels_read_fp8_pools_as_their_values():
    """Reference, chunked (XLA) and ragged (Pallas, interpreted): every token of every sequence."""
    rng, k_pool, v_pool, tables, lengths = _fp8_case()
    q = rng.normal(size=(int(lengths.sum()), 8, 64)).astype(np.float32)
    seq_ids = np.repeat(np.arange(4), lengths).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    query_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    scale = 64 ** -0.5
    want = np.concatenate([
        attention_f64(q[query_start[s]:query_start[s + 1]], _kv_f64(k_pool, tables, s, lengths[s]),
                      _kv_f64(v_pool, tables, s, lengths[s]), range(lengths[s]), scale) for s in range(4)])
    args = (jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool))
    outputs = {
        "reference": paged_attention_reference(*args, 1, jnp.asarray(tables), jnp.asarray(seq_ids),
                                               jnp.asarray(positions), scale=scale),
        "chunked": paged_attention_chunked(*args, 1, jnp.asarray(tables), jnp.asarray(seq_ids),
                                           jnp.asarray(positions), scale=scale),
        "ragged": ragged_paged_attention(*args, jnp.asarray(tables), jnp.asarray(query_start),
                                         jnp.asarray(lengths), 1, None, scale=scale, interpret=True),
    }
    for name, out in outputs.items():
        # float32 math on exactly the fp8 values, over <= 48 keys: float32 rounding only.
        np.testing.assert_allclose(np.asarray(out), want, atol=1e-4, rtol=1e-4, err_msg=name)


def test_decode_kernel_reads_fp8_pools_as_their_values():
    rng, k_pool, v_pool, tables, lengths = _fp8_case(seed=1)
    q = rng.normal(size=(4, 8, 64)).astype(np.float32)
    scale = 64 ** -0.5
    want = np.concatenate([attention_f64(q[s:s + 1], _kv_f64(k_pool, tables, s, lengths[s]),
                                         _kv_f64(v_pool, tables, s, lengths[s]), [lengths[s] - 1], scale)
                           for s in range(4)])
    for splits in (1, 2):
        out = paged_decode_attention(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(tables),
                                     jnp.asarray(lengths), 1, None, scale=scale, num_splits=splits, interpret=True)
        np.testing.assert_allclose(np.asarray(out), want, atol=1e-4, rtol=1e-4, err_msg=f"{splits} splits")
