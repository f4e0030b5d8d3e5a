"""The TPU ragged kernel under the TPU interpreter (`pltpu.InterpretParams`) against a float64 numpy reference.

The interpreter runs the kernel's DMAs, semaphores and VMEM buffers as a TPU would order them; with
`uninitialized_memory="nan"` every output and scratch buffer starts as NaN, so a row the kernel never writes,
or a buffer slot read before its copy landed, shows. Every case runs with `detect_races`, which checks each
DMA against the reads and writes of its buffers.

Tolerances (kernel_inputs.tolerance): float32 as for the other kernels (the MXU products at HIGHEST
precision). bfloat16: both sides see the same bf16 inputs; the kernel rounds P to bf16 for P.V, as TPU
kernels do for the MXU (at most 2^-9 relative per weight, so at most 2^-9 x max|v| ~ 8e-3 with every error
aligned, ~1e-3 in practice), then rounds its output once (2^-8 relative): 1.6e-2 still holds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl

from paged.kernels import ragged_paged_attention_reference
from paged.kernels.tpu.block_sizes import block_sizes, tokens_per_block_for
from paged.kernels.tpu.ragged import interpret_params, ragged_paged_attention_tpu
from tests.pallas_kernels.kernel_inputs import (HEAD_CONFIGS, HEAD_IDS, LAYER, PADDING_TOKENS, PAGES_PER_SEQ,
                                                random_ragged_args, ragged_batch, ragged_f64, random_pool,
                                                tolerance)

pytestmark = pytest.mark.tpu_interpreter


def run_case(rng, page_size, num_q_heads, num_kv_heads, head_dim, dtype, *, window=None, soft_cap=None,
             tokens_per_block=None, pages_per_step=None):
    seqs = ragged_batch(page_size)  # lengths 0, 1, a page, the maximum; decode rows and prompt chunks mixed
    inputs = random_pool(rng, len(seqs), PAGES_PER_SEQ, num_kv_heads, page_size, head_dim, dtype)
    query_start = np.concatenate([[0], np.cumsum([n for n, _ in seqs])]).astype(np.int32)
    q = rng.normal(size=(query_start[-1] + PADDING_TOKENS, num_q_heads, head_dim)).astype(dtype)
    scale = head_dim ** -0.5
    out = ragged_paged_attention_tpu(
        jnp.asarray(q), jnp.asarray(inputs.k_pages), jnp.asarray(inputs.v_pages), jnp.asarray(inputs.page_tables),
        jnp.asarray(query_start), jnp.asarray([c for _, c in seqs], jnp.int32), LAYER, window, scale=scale,
        soft_cap=soft_cap, tokens_per_block=tokens_per_block, pages_per_step=pages_per_step,
        interpret=interpret_params(detect_races=True))
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ragged_f64(q, inputs, seqs, query_start, scale, window, soft_cap),
                               **tolerance(dtype))
    np.testing.assert_array_equal(out[query_start[-1]:], 0.0)


# Every page size with every head layout, head_dim 64 and 128 alternating (each meets each page size).
CASES = [(ps, heads, 64 if (i + j) % 2 else 128) for i, ps in enumerate([16, 32, 64])
         for j, heads in enumerate(HEAD_CONFIGS)]


@pytest.mark.parametrize("page_size, heads, head_dim", CASES,
                         ids=[f"page{ps}-{HEAD_IDS[HEAD_CONFIGS.index(h)]}-d{d}" for ps, h, d in CASES])
def test_float32(page_size, heads, head_dim):
    rng = np.random.default_rng([page_size, *heads, head_dim, 11])
    run_case(rng, page_size, *heads, head_dim, np.float32)


@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim",
                         [(*heads, 128 if i % 2 else 64) for i, heads in enumerate(HEAD_CONFIGS)], ids=HEAD_IDS)
def test_bfloat16(num_q_heads, num_kv_heads, head_dim):
    rng = np.random.default_rng([num_q_heads, num_kv_heads, head_dim, 12])
    run_case(rng, 16, num_q_heads, num_kv_heads, head_dim, ml_dtypes.bfloat16)


@pytest.mark.parametrize("window", [1, 40])  # itself only; across pages (no window: every other case)
def test_sliding_window_and_soft_cap(window):
    run_case(np.random.default_rng(window + 13), 16, 8, 2, 64, np.float32, window=window, soft_cap=2.0)


@pytest.mark.parametrize("tokens_per_block, pages_per_step", [(1, 1), (64, 3)])
def test_block_and_step_sizes(tokens_per_block, pages_per_step):
    """Blocks of one token (the decode block with a group of 8) and one page per step (the most DMA waits);
    a block larger than every sequence, with steps that overrun the table's last page."""
    run_case(np.random.default_rng(tokens_per_block), 16, 16, 2, 64, np.float32,
             tokens_per_block=tokens_per_block, pages_per_step=pages_per_step)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
def test_many_double_buffered_steps(dtype):
    """Two pages per step: every row of the batch walks several steps, so the next step's copies are in
    flight while the last step's buffer is read (the race detector, on in every case, watches them)."""
    run_case(np.random.default_rng(14), 16, 4, 2, 128, dtype, pages_per_step=2)


def test_matches_its_jnp_twin_on_a_random_batch():
    args = random_ragged_args(np.random.default_rng(15), window=9)
    np.testing.assert_allclose(ragged_paged_attention_tpu(*args, scale=0.125, interpret=True),
                               ragged_paged_attention_reference(*args, scale=0.125), atol=2e-5, rtol=2e-5)


def test_the_interpreter_poisons_what_a_kernel_does_not_write():
    """What makes the finiteness checks above meaningful: an output the kernel leaves alone reads NaN."""
    def leaves_output_alone(x_ref, o_ref):
        pass

    out = pl.pallas_call(leaves_output_alone, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                         interpret=interpret_params())(jnp.zeros((8, 128), jnp.float32))
    assert np.isnan(np.asarray(out)).all()


def test_tokens_per_block_meets_the_tpu_tiling():
    for group in (1, 2, 3, 4, 7, 8, 16):
        for dtype, tile in ((jnp.float32, 8), (jnp.bfloat16, 16)):
            for rows in (1, 256, 512):
                tokens = tokens_per_block_for(rows, group, dtype)
                assert tokens & (tokens - 1) == 0 and (tokens * group) % tile == 0
                assert tokens * group >= rows and (tokens == 1 or tokens * group < 2 * rows or
                                                   (tokens // 2 * group) % tile)
    assert tokens_per_block_for(1, 8, jnp.bfloat16) == 2  # a decode block: one token, 16 rows
    assert block_sizes("TPU v6 lite").prefill_rows == 512 and block_sizes("TPU v5 lite").keys_per_step == 256
    assert block_sizes("TPU v5p").keys_per_step == 512 and block_sizes("cpu") == block_sizes("anything else")


def test_rejects_what_tpu_tiling_cannot_hold():
    pool = jnp.zeros((1, 2, 8, 12, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="page_size must be a multiple of 16 for a bfloat16 pool"):
        ragged_paged_attention_tpu(jnp.zeros((4, 4, 64), jnp.bfloat16), pool, pool, jnp.zeros((2, 3), jnp.int32),
                                   jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32), scale=1.0)
    pool = jnp.zeros((1, 2, 8, 16, 64), jnp.float32)
    with pytest.raises(ValueError, match="tokens_per_block must be a power of two"):
        ragged_paged_attention_tpu(jnp.zeros((4, 4, 64)), pool, pool, jnp.zeros((2, 3), jnp.int32),
                                   jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32), scale=1.0,
                                   tokens_per_block=3)
    with pytest.raises(ValueError, match=r"query_start must be int32 \[num_seqs \+ 1 = 3\]"):
        ragged_paged_attention_tpu(jnp.zeros((4, 4, 64)), pool, pool, jnp.zeros((2, 3), jnp.int32),
                                   jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32), scale=1.0)
