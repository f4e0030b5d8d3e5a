"""The Hopper (Mosaic GPU) decode kernel: under the Mosaic GPU interpreter against float64 numpy, and its
real Mosaic GPU lowering for CUDA (shared-memory budget, TMA and wgmma shapes), both without a GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from paged.kernels.gpu.decode_mgpu import paged_decode_attention_mgpu
from tests.pallas_kernels.kernel_inputs import LAYER, random_pool
from tests.pallas_kernels.test_decode import decode_f64
from tests.pallas_kernels.test_gpu_lowering import lower_for_cuda

JAX_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])
needs_gpu_interpreter = pytest.mark.skipif(
    JAX_VERSION < (0, 11), reason="the Mosaic GPU interpreter of jax 0.10 has no rule for layout_cast; "
                                  "the jax 0.12 CI leg runs these (they pass on 0.11.2, the GPU machine's jax)")
# bf16/f16: scores and the weighted sum run on wgmma with bf16 inputs, and the probabilities are rounded to
# the input dtype before the second wgmma (relative step 2^-8): the output moves by at most ~2^-9 of
# max|v| (~4 for normal data) plus its own rounding; 2e-2 covers both with margin.
TOLERANCE = dict(atol=2e-2, rtol=2e-2)
PAGES_PER_SEQ = 6


def run_case(rng, page_size, num_q_heads, num_kv_heads, head_dim):
    lengths = [0, 1, page_size, 2 * page_size + 3, PAGES_PER_SEQ * page_size]
    inputs = random_pool(rng, len(lengths), PAGES_PER_SEQ, num_kv_heads, page_size, head_dim, ml_dtypes.bfloat16)
    q = rng.normal(size=(len(lengths), num_q_heads, head_dim)).astype(ml_dtypes.bfloat16)
    scale = head_dim ** -0.5
    out = paged_decode_attention_mgpu(
        jnp.asarray(q), jnp.asarray(inputs.k_pages), jnp.asarray(inputs.v_pages), jnp.asarray(inputs.page_tables),
        jnp.asarray(lengths, jnp.int32), LAYER, scale=scale, interpret=True)
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()  # the interpreter fills unwritten memory with NaN
    return out, decode_f64(q, inputs, lengths, scale)


@needs_gpu_interpreter
@pytest.mark.parametrize("page_size, head_dim", [(8, 64), (16, 128), (32, 64)])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(2, 2), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa8"])
def test_interpreted_matches_float64(page_size, head_dim, num_q_heads, num_kv_heads):
    rng = np.random.default_rng([page_size, head_dim, num_q_heads, num_kv_heads, 2])
    out, expected = run_case(rng, page_size, num_q_heads, num_kv_heads, head_dim)
    np.testing.assert_allclose(out, expected, **TOLERANCE)


@needs_gpu_interpreter
def test_interpreted_float16_split_kv_window_and_soft_cap():
    rng = np.random.default_rng(11)
    lengths = [0, 1, 16, 35, 96]
    inputs = random_pool(rng, len(lengths), PAGES_PER_SEQ, 2, 16, 64, np.float16)
    q = rng.normal(size=(len(lengths), 8, 64)).astype(np.float16)
    for splits, window, cap in ((2, None, None), (3, 20, 2.0)):
        out = paged_decode_attention_mgpu(
            jnp.asarray(q), jnp.asarray(inputs.k_pages), jnp.asarray(inputs.v_pages),
            jnp.asarray(inputs.page_tables), jnp.asarray(lengths, jnp.int32), LAYER, window, scale=0.125,
            soft_cap=cap, num_splits=splits, stages=2, interpret=True)
        out = np.asarray(out.astype(jnp.float32))
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, decode_f64(q, inputs, lengths, 0.125, window, cap), **TOLERANCE)


@pytest.mark.parametrize("group, head_dim, page_size, num_splits, stages",
                         [(1, 64, 16, 1, 2), (4, 128, 16, 4, 3), (8, 128, 32, 1, 4), (64, 128, 8, 2, 3)])
def test_lowers_with_mosaic_gpu(group, head_dim, page_size, num_splits, stages):
    sds = jax.ShapeDtypeStruct
    pool = sds((2, 8, 1024, page_size, head_dim), jnp.bfloat16)
    fn = functools.partial(paged_decode_attention_mgpu, scale=0.1, soft_cap=20.0, num_splits=num_splits,
                           stages=stages)
    text = lower_for_cuda(fn, sds((32, 8 * group, head_dim), jnp.bfloat16), pool, pool, sds((32, 128), jnp.int32),
                          sds((32,), jnp.int32))
    assert "mosaic_gpu" in text


def test_lowering_catches_shared_memory_overflow():
    """The smoke test above can fail: a ring too deep for the 227 KiB of shared memory is refused."""
    sds = jax.ShapeDtypeStruct
    pool = sds((1, 8, 1024, 16, 128), jnp.bfloat16)
    fn = functools.partial(paged_decode_attention_mgpu, scale=0.1, stages=16)
    with pytest.raises(ValueError, match="shared memory"):
        lower_for_cuda(fn, sds((32, 32, 128), jnp.bfloat16), pool, pool, sds((32, 128), jnp.int32),
                       sds((32,), jnp.int32))


def test_rejects_what_the_hardware_path_cannot_do():
    pool = jnp.zeros((1, 2, 8, 16, 64), jnp.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        paged_decode_attention_mgpu(jnp.zeros((2, 4, 64)), pool, pool, jnp.zeros((2, 4), jnp.int32),
                                    jnp.zeros((2,), jnp.int32), scale=1.0)
    pool = jnp.zeros((1, 2, 8, 16, 96), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 64"):
        paged_decode_attention_mgpu(jnp.zeros((2, 4, 96), jnp.bfloat16), pool, pool, jnp.zeros((2, 4), jnp.int32),
                                    jnp.zeros((2,), jnp.int32), scale=1.0)
