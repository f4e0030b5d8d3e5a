"""The native pool writes (pallas_kernels/cpu/kv_write.cc) against numpy, in every dtype they move."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged.kernels import cpu, write_kv_to_cache
from tests.native import needs_compiler

pytestmark = needs_compiler

SHAPE = (3, 2, 9, 4, 8)  # L, Hkv, NB, bs, D
DTYPES = [np.float32, jnp.bfloat16, np.float16]


def pools(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(SHAPE).astype(dtype) for _ in range(2))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
def test_write_kv_matches_numpy(dtype):
    k_pool, v_pool = pools(dtype)
    rng = np.random.default_rng(1)
    k, v = (rng.standard_normal((6, 2, 8)).astype(dtype) for _ in range(2))
    slots = np.array([0, 5, 35, 13, -1, 36], np.int32)  # -1 and 36 (= NB * bs) lie outside the pool: skipped
    got = cpu.write_kv_cpu(jnp.asarray(k_pool), jnp.asarray(v_pool), 2, jnp.asarray(k), jnp.asarray(v),
                           jnp.asarray(slots))
    for pool, new, out in ((k_pool, k, got[0]), (v_pool, v, got[1])):
        want = pool.copy()
        for t, slot in enumerate(slots):
            if 0 <= slot < 36:
                want[2, :, slot // 4, slot % 4] = new[t]
        np.testing.assert_array_equal(np.asarray(out), want)
    # The same as the jax.numpy reference for the slots it writes.
    ref = write_kv_to_cache(jnp.asarray(k_pool), jnp.asarray(v_pool), 2, jnp.asarray(k[:4]), jnp.asarray(v[:4]),
                            jnp.asarray(slots[:4]))
    nat = cpu.write_kv_cpu(jnp.asarray(k_pool), jnp.asarray(v_pool), 2, jnp.asarray(k[:4]), jnp.asarray(v[:4]),
                           jnp.asarray(slots[:4]))
    for a, b in zip(ref, nat):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
def test_copy_and_scatter_blocks_match_numpy(dtype):
    k_pool, v_pool = pools(dtype)
    src, dst = np.array([1, 0, 3, 2], np.int32), np.array([4, 0, 7, 99], np.int32)  # 0 -> 0 and 99: no-ops
    got = cpu.copy_blocks_cpu(jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(src), jnp.asarray(dst))
    for pool, out in zip((k_pool, v_pool), got):
        want = pool.copy()
        want[:, :, [4, 7]] = pool[:, :, [1, 3]]
        np.testing.assert_array_equal(np.asarray(out), want)

    rng = np.random.default_rng(2)
    data = tuple(rng.standard_normal((3, 2, 3, 4, 8)).astype(dtype) for _ in range(2))
    ids = np.array([8, 2, -3], np.int32)
    got = cpu.scatter_blocks_cpu(jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(ids), *map(jnp.asarray, data))
    for pool, d, out in zip((k_pool, v_pool), data, got):
        want = pool.copy()
        want[:, :, [8, 2]] = d[:, :, [0, 1]]
        np.testing.assert_array_equal(np.asarray(out), want)


def test_writes_happen_in_place_under_donation():
    """Inside a jitted step with the pool donated, the result is the pool's own buffer (no copy of it)."""
    k_pool, v_pool = (jnp.asarray(p) for p in pools(jnp.bfloat16))
    before = k_pool.unsafe_buffer_pointer(), v_pool.unsafe_buffer_pointer()
    step = jax.jit(lambda kv, k, slots: cpu.write_kv_cpu(*kv, 1, k, k, slots), donate_argnums=(0,))
    k = jnp.ones((2, 2, 8), jnp.bfloat16)
    k_pool, v_pool = step((k_pool, v_pool), k, jnp.array([3, 4], jnp.int32))
    assert (k_pool.unsafe_buffer_pointer(), v_pool.unsafe_buffer_pointer()) == before
    assert float(k_pool[1, 0, 0, 3, 0]) == 1.0 and float(v_pool[1, 1, 1, 0, 7]) == 1.0


def test_only_16bit_cpu_pools_take_the_native_path():
    assert cpu.writes_pool_natively(jnp.bfloat16) and cpu.writes_pool_natively(jnp.float16)
    assert not cpu.writes_pool_natively(jnp.float32)  # XLA's own scatter is in place for float32


def test_bad_shapes_are_refused():
    k_pool, v_pool = (jnp.asarray(p) for p in pools(np.float32))
    with pytest.raises(ValueError, match="slot_mapping"):
        cpu.write_kv_cpu(k_pool, v_pool, 0, jnp.zeros((2, 3, 8)), jnp.zeros((2, 3, 8)), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="data"):
        cpu.scatter_blocks_cpu(k_pool, v_pool, jnp.zeros(2, jnp.int32), jnp.zeros((3, 2, 3, 4, 8)),
                               jnp.zeros((3, 2, 3, 4, 8)))
    with pytest.raises(ValueError, match="src, dst"):
        cpu.copy_blocks_cpu(k_pool, v_pool, jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.int32))
