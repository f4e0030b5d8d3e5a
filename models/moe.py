"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) with a grouped expert computation.

Each token picks `top_k` experts. The (token, expert) assignments are sorted by expert, so every expert
multiplies only the rows routed to it: a grouped matmul over contiguous row groups, never a dense pass of
every expert over every token. On GPU/TPU the grouped matmul is `jax.lax.ragged_dot` (a native grouped
GEMM there); on CPU, where jax lowers `ragged_dot` densely, the groups are padded to tiles of `TILE_ROWS`
rows and a loop over tiles multiplies each tile by its one expert's weights: (T * top_k + E * TILE_ROWS)
rows of work instead of T * E.

Parameters (per layer; the decoder stacks them over layers):
    gate/kernel                    [H, E]      router
    experts/{gate,up}_proj         [E, H, I]
    experts/down_proj              [E, I, H]
    shared_expert/{gate,up,down}_proj/kernel, shared_expert_gate/kernel [H, 1]   (Qwen2-MoE only)
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.layers import GatedMLP, activation

# Rows per tile of the CPU grouped matmul: large enough for an efficient matmul, small enough that padding
# each expert's group to a tile boundary (at most TILE_ROWS - 1 rows per expert) stays cheap.
TILE_ROWS = 16


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tiled: bool | None = None) -> jax.Array:
    """Rows of `x` sorted by group times their group's matrix.

    Args:
      x: [M, K], rows of group 0 first, then group 1, ... (rows past sum(group_sizes) are ignored: zeros).
      w: [G, K, N].
      group_sizes: int32 [G].
      tiled: use the tile loop (default: on CPU) instead of `jax.lax.ragged_dot`.
    Returns:
      [M, N] in x's dtype.
    """
    if tiled is None:
        tiled = jax.default_backend() == "cpu"
    if not tiled:
        return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32
                                  ).astype(x.dtype)
    num_rows, num_groups = x.shape[0], w.shape[0]
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    padded_sizes = (group_sizes + TILE_ROWS - 1) // TILE_ROWS * TILE_ROWS
    padded_ends = jnp.cumsum(padded_sizes)
    padded_starts = padded_ends - padded_sizes
    row = jnp.arange(num_rows, dtype=jnp.int32)
    row_group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), num_groups - 1)
    real = row < ends[-1]
    dest = jnp.where(real, padded_starts[row_group] + row - starts[row_group], -1)
    num_tiles = -(-num_rows // TILE_ROWS) + num_groups  # static bound on the padded layout
    padded = jnp.zeros((num_tiles * TILE_ROWS, x.shape[1]), x.dtype).at[dest].set(x, mode="drop")
    tiles = padded.reshape(num_tiles, TILE_ROWS, x.shape[1])
    tile_group = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(num_tiles) * TILE_ROWS, side="right"),
                             num_groups - 1)
    tile_used = jnp.arange(num_tiles) * TILE_ROWS < padded_ends[-1]

    def one_tile(_, xs):
        tile, group, used = xs
        out = jax.lax.cond(used, lambda: jnp.dot(tile, w[group], preferred_element_type=jnp.float32),
                           lambda: jnp.zeros((TILE_ROWS, w.shape[2]), jnp.float32))
        return None, out.astype(x.dtype)

    _, out = jax.lax.scan(one_tile, None, (tiles, tile_group, tile_used))
    out = out.reshape(num_tiles * TILE_ROWS, w.shape[2])
    return jnp.where(real[:, None], out[jnp.maximum(dest, 0)], 0)


class SparseMoE(nn.Module):
    """Top-k routed experts (softmax router in float32), plus Qwen2-MoE's sigmoid-gated shared expert."""

    config: ModelConfig
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        num_tokens, hidden = x.shape
        num_experts, top_k, inter = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        router = nn.Dense(num_experts, use_bias=False, dtype=self.dtype, param_dtype=self.dtype, name="gate")
        probs = jax.nn.softmax(router(x).astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, top_k)  # [T, k]
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)

        init = nn.initializers.lecun_normal()
        w_gate = self.param("experts_gate_proj", init, (num_experts, hidden, inter), self.dtype)
        w_up = self.param("experts_up_proj", init, (num_experts, hidden, inter), self.dtype)
        w_down = self.param("experts_down_proj", init, (num_experts, inter, hidden), self.dtype)

        flat_expert = experts.reshape(-1)
        order = jnp.argsort(flat_expert, stable=True)
        token = (jnp.arange(num_tokens * top_k, dtype=jnp.int32) // top_k)[order]
        group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
        rows = x[token]
        act = activation(cfg.hidden_act)
        h = act(grouped_matmul(rows, w_gate, group_sizes)) * grouped_matmul(rows, w_up, group_sizes)
        y = grouped_matmul(h, w_down, group_sizes).astype(jnp.float32) * weights.reshape(-1)[order][:, None]
        out = jnp.zeros((num_tokens, hidden), jnp.float32).at[token].add(y).astype(self.dtype)

        if cfg.shared_expert_intermediate_size:
            shared = GatedMLP(cfg, self.dtype, intermediate_size=cfg.shared_expert_intermediate_size,
                              name="shared_expert")(x)
            gate = nn.Dense(1, use_bias=False, dtype=self.dtype, param_dtype=self.dtype, name="shared_expert_gate")
            out = out + jax.nn.sigmoid(gate(x)) * shared
        return out
