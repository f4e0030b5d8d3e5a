"""The kernels lower for NVIDIA GPUs without one: the real Triton lowering runs on CPU.

Catches what interpret mode accepts but a GPU does not: non-power-of-two tiles, dots with too few rows,
unsupported indexing. (Compiling the PTX still needs a GPU.)
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import pytest

from paged.kernels import paged_decode_attention, ragged_paged_attention


def gpu_target():
    """jax >= 0.12 reads the GPU model from an abstract mesh when no GPU is attached; 0.10 needs nothing."""
    if not hasattr(jax.sharding, "AbstractDevice"):
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


def lower_for_cuda(fn, *args):
    with gpu_target():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def pool_args(num_seqs, num_q_heads, num_kv_heads, head_dim, page_size, dtype, num_tokens=None):
    sds = jax.ShapeDtypeStruct
    pool = sds((2, num_kv_heads, 256, page_size, head_dim), dtype)
    return (sds((num_tokens or num_seqs, num_q_heads, head_dim), dtype), pool, pool,
            sds((num_seqs, 32), jnp.int32))


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("head_dim, page_size", [(128, 16), (64, 32)])
def test_decode_lowers_with_triton(group, dtype, head_dim, page_size):
    q, k, v, tables = pool_args(32, 2 * group, 2, head_dim, page_size, dtype)
    fn = functools.partial(paged_decode_attention, scale=0.1, soft_cap=30.0, num_splits=4, interpret=False)
    text = lower_for_cuda(fn, q, k, v, tables, jax.ShapeDtypeStruct((32,), jnp.int32))
    assert "triton" in text.lower()


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_ragged_lowers_with_triton(group, dtype):
    q, k, v, tables = pool_args(8, 2 * group, 2, 128, 16, dtype, num_tokens=256)
    sds = jax.ShapeDtypeStruct
    fn = functools.partial(ragged_paged_attention, scale=0.1, interpret=False)
    text = lower_for_cuda(fn, q, k, v, tables, sds((9,), jnp.int32), sds((8,), jnp.int32))
    assert "triton" in text.lower()
