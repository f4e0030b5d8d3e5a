"""The portable Pallas ragged kernel (interpret mode) against a float64 numpy reference."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from paged.kernels import ragged_paged_attention, ragged_paged_attention_reference
from tests.pallas_kernels.kernel_inputs import (HEAD_CONFIGS, HEAD_IDS, LAYER, PADDING_TOKENS, PAGES_PER_SEQ,
                                                random_ragged_args, ragged_batch, ragged_f64, random_pool,
                                                tolerance)


def run_case(rng, page_size, num_q_heads, num_kv_heads, head_dim, dtype, *, window=None, soft_cap=None,
             tokens_per_block=None):
    seqs = ragged_batch(page_size)
    inputs = random_pool(rng, len(seqs), PAGES_PER_SEQ, num_kv_heads, page_size, head_dim, dtype)
    query_start = np.concatenate([[0], np.cumsum([n for n, _ in seqs])]).astype(np.int32)
    num_tokens = query_start[-1] + PADDING_TOKENS
    q = rng.normal(size=(num_tokens, num_q_heads, head_dim)).astype(dtype)
    scale = head_dim ** -0.5
    out = ragged_paged_attention(
        jnp.asarray(q), jnp.asarray(inputs.k_pages), jnp.asarray(inputs.v_pages), jnp.asarray(inputs.page_tables),
        jnp.asarray(query_start), jnp.asarray([c for _, c in seqs], jnp.int32), LAYER, window, scale=scale,
        soft_cap=soft_cap, tokens_per_block=tokens_per_block, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()  # interpret mode poisons outputs with NaN (see test_decode)
    expected = ragged_f64(q, inputs, seqs, query_start, scale, window, soft_cap)
    np.testing.assert_allclose(out, expected, **tolerance(dtype))
    np.testing.assert_array_equal(out[query_start[-1]:], 0.0)


@pytest.mark.parametrize("page_size", [8, 16, 32])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", HEAD_CONFIGS, ids=HEAD_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_ragged_float32(page_size, num_q_heads, num_kv_heads, head_dim):
    rng = np.random.default_rng([page_size, num_q_heads, num_kv_heads, head_dim, 1])
    run_case(rng, page_size, num_q_heads, num_kv_heads, head_dim, np.float32)


@pytest.mark.parametrize("num_q_heads, num_kv_heads", HEAD_CONFIGS, ids=HEAD_IDS)
def test_ragged_bfloat16(num_q_heads, num_kv_heads):
    run_case(np.random.default_rng(num_q_heads + 50), 16, num_q_heads, num_kv_heads, 128, ml_dtypes.bfloat16)


@pytest.mark.parametrize("tokens_per_block", [1, 3, 64])
def test_block_sizes(tokens_per_block):
    """Query blocks smaller than a page, not dividing the chunks, and larger than every sequence."""
    run_case(np.random.default_rng(tokens_per_block), 8, 8, 2, 64, np.float32, tokens_per_block=tokens_per_block)


@pytest.mark.parametrize("window", [1, 6, 20, 0])
def test_sliding_window_and_soft_cap(window):
    run_case(np.random.default_rng(window + 9), 8, 4, 2, 64, np.float32, window=window, soft_cap=2.0,
             tokens_per_block=4)


def test_matches_its_jnp_reference_on_a_random_batch():
    args = random_ragged_args(np.random.default_rng(3), window=7)
    np.testing.assert_allclose(ragged_paged_attention(*args, scale=0.125, interpret=True),
                               ragged_paged_attention_reference(*args, scale=0.125), atol=2e-5, rtol=2e-5)


def test_rejects_bad_offsets_shape():
    pool = jnp.zeros((1, 2, 8, 16, 64))
    with pytest.raises(ValueError, match=r"query_start must be int32 \[num_seqs \+ 1 = 3\]"):
        ragged_paged_attention(jnp.zeros((4, 4, 64)), pool, pool, jnp.zeros((2, 3), jnp.int32),
                               jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32), scale=1.0)
