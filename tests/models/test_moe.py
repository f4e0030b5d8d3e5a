"""The grouped expert matmul and the MoE block against dense float64 numpy (the HF parity tests cover routing
end to end)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from paged.models.moe import TILE_ROWS, grouped_matmul


@pytest.mark.parametrize("tiled", [True, False], ids=["tiles", "ragged_dot"])
@pytest.mark.parametrize("sizes", [[5, 0, 17, 2], [0, 0, 0, 40], [TILE_ROWS, 1, TILE_ROWS + 1, 0], [0, 0, 0, 0]])
def test_grouped_matmul_matches_per_group_products(tiled, sizes):
    rng = np.random.default_rng(len(sizes) + sum(sizes))
    num_rows = sum(sizes) + 3  # trailing rows belong to no group
    x = rng.normal(size=(num_rows, 24)).astype(np.float32)
    w = rng.normal(size=(len(sizes), 24, 10)).astype(np.float32)
    expected = np.zeros((num_rows, 10))
    start = 0
    for g, n in enumerate(sizes):
        expected[start:start + n] = x[start:start + n].astype(np.float64) @ w[g].astype(np.float64)
        start += n
    got = grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32), tiled=tiled)
    np.testing.assert_allclose(np.asarray(got)[:sum(sizes)], expected[:sum(sizes)], atol=1e-4, rtol=1e-4)
    if tiled:
        np.testing.assert_array_equal(np.asarray(got)[sum(sizes):], 0.0)
