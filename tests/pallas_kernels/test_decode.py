"""The portable Pallas decode kernel (interpret mode) against a float64 numpy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl

from paged.kernels import paged_decode_attention, paged_decode_reference
from tests.pallas_kernels.kernel_inputs import (HEAD_CONFIGS, HEAD_IDS, LAYER, attention_f64, random_pool,
                                                tolerance)

PAGES_PER_SEQ = 6


def decode_f64(q, inputs, lengths, scale, window=None, soft_cap=None):
    num_kv_heads = inputs.k_pages.shape[1]
    out = np.zeros(q.shape, np.float64)
    for s, n in enumerate(lengths):
        if n == 0:
            continue  # padded row: zeros
        kv = [inputs.keys(s, n, h) for h in range(num_kv_heads)]
        out[s:s + 1] = attention_f64(q[s:s + 1], [k for k, _ in kv], [v for _, v in kv], [n - 1], scale,
                                     window, soft_cap)
    return out


def run_case(rng, page_size, num_q_heads, num_kv_heads, head_dim, dtype, *, window=None, soft_cap=None,
             num_splits=1):
    # Lengths 0 (padded row), 1, one page, a partial page, and the whole table.
    lengths = [0, 1, page_size, 2 * page_size + 3, PAGES_PER_SEQ * page_size]
    inputs = random_pool(rng, len(lengths), PAGES_PER_SEQ, num_kv_heads, page_size, head_dim, dtype)
    q = rng.normal(size=(len(lengths), num_q_heads, head_dim)).astype(dtype)
    scale = head_dim ** -0.5
    out = paged_decode_attention(
        jnp.asarray(q), jnp.asarray(inputs.k_pages), jnp.asarray(inputs.v_pages), jnp.asarray(inputs.page_tables),
        jnp.asarray(lengths, jnp.int32), LAYER, window, scale=scale, soft_cap=soft_cap, num_splits=num_splits,
        interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(jnp.float32))
    # Interpret mode fills outputs with NaN before the kernel runs: an element never written stays NaN.
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, decode_f64(q, inputs, lengths, scale, window, soft_cap), **tolerance(dtype))
    np.testing.assert_array_equal(out[0], 0.0)


@pytest.mark.parametrize("page_size", [8, 16, 32])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", HEAD_CONFIGS, ids=HEAD_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_float32(page_size, num_q_heads, num_kv_heads, head_dim):
    rng = np.random.default_rng([page_size, num_q_heads, num_kv_heads, head_dim])
    run_case(rng, page_size, num_q_heads, num_kv_heads, head_dim, np.float32)


@pytest.mark.parametrize("num_q_heads, num_kv_heads", HEAD_CONFIGS, ids=HEAD_IDS)
def test_decode_bfloat16(num_q_heads, num_kv_heads):
    run_case(np.random.default_rng(num_q_heads), 16, num_q_heads, num_kv_heads, 128, ml_dtypes.bfloat16)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_kv_matches(num_splits):
    """Split-KV, including more splits than some sequences have pages (empty splits merge as nothing)."""
    run_case(np.random.default_rng(num_splits), 8, 8, 2, 64, np.float32, num_splits=num_splits)


@pytest.mark.parametrize("window", [1, 5, 16, 0])
def test_sliding_window_and_soft_cap(window):
    run_case(np.random.default_rng(window), 8, 4, 2, 64, np.float32, window=window, soft_cap=2.0, num_splits=2)


def test_window_is_traceable_per_layer():
    """One compiled function serves layers with different windows (the engine scans over layers)."""
    rng = np.random.default_rng(7)
    inputs = random_pool(rng, 3, 4, 2, 8, 64, np.float32)
    lengths = jnp.asarray([5, 20, 32], jnp.int32)
    q = jnp.asarray(rng.normal(size=(3, 4, 64)).astype(np.float32))
    fn = jax.jit(lambda w: paged_decode_attention(q, inputs.k_pages, inputs.v_pages, inputs.page_tables, lengths,
                                                  LAYER, w, scale=0.125, interpret=True))
    for window in (0, 4, 9):
        expected = paged_decode_reference(q, inputs.k_pages, inputs.v_pages, inputs.page_tables, lengths, LAYER,
                                          window, scale=0.125)
        np.testing.assert_allclose(fn(jnp.int32(window)), expected, atol=2e-5, rtol=2e-5)


def test_interpret_mode_poisons_outputs():
    """The premise of the finiteness checks above: an output the kernel never writes reads as NaN."""
    out = pl.pallas_call(lambda o_ref: None, out_shape=jax.ShapeDtypeStruct((4, 8), jnp.float32),
                         interpret=True)()
    assert np.isnan(np.asarray(out)).all()


def test_rejects_bad_shapes_with_clear_errors():
    q = jnp.zeros((2, 6, 64))
    pool = jnp.zeros((1, 4, 8, 16, 64))
    tables, lengths = jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="num_q_heads=6 is not a multiple of num_kv_heads=4"):
        paged_decode_attention(q, pool, pool, tables, lengths, scale=1.0)
    with pytest.raises(ValueError, match="lengths must be int32"):
        paged_decode_attention(jnp.zeros((2, 8, 64)), pool, pool, tables, lengths.astype(jnp.float32), scale=1.0)
    with pytest.raises(ValueError, match="head_dim 32 != pool head_dim 64"):
        paged_decode_attention(jnp.zeros((2, 8, 32)), pool, pool, tables, lengths, scale=1.0)
