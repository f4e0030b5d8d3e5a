"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) with a grouped expert computation.

Each token picks `top_k` experts. The (token, expert) assignments are sorted by expert, so every expert
multiplies only the rows routed to it: a grouped matmul over contiguous row groups (`GroupedLinear`, see
`paged.models.linear.grouped_matmul`), never a dense pass of every expert over every token.

Parameters (per layer; the decoder stacks them over layers):
    gate/kernel                                 [H, E]      router
    experts_gate_proj/kernel, experts_up_proj/kernel   [E, H, I]
    experts_down_proj/kernel                    [E, I, H]
    shared_expert/{gate,up,down}_proj/kernel, shared_expert_gate/kernel [H, 1]   (Qwen2-MoE only)
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from paged.models.layers import Block, GatedMLP, activation
from paged.models.linear import TILE_ROWS, GroupedLinear, Linear, grouped_matmul

__all__ = ["SparseMoE", "TILE_ROWS", "grouped_matmul"]


class SparseMoE(Block):
    """Top-k routed experts (softmax router in float32), plus Qwen2-MoE's sigmoid-gated shared expert."""

    @nn.compact
    def __call__(self, x: jax.Array, live_rows: jax.Array | None = None) -> jax.Array:
        cfg = self.config
        num_tokens, hidden = x.shape
        num_experts, top_k, inter = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        router = Linear(num_experts, self.dtype, backend=self.linear_backend, name="gate")
        probs = jax.nn.softmax(router(x, live_rows).astype(jnp.float32), axis=-1)
        weights, chosen = jax.lax.top_k(probs, top_k)  # [T, k]
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)

        experts = lambda n, name, parallel: GroupedLinear(n, num_experts, self.dtype, parallel,
                                                          quant=cfg.weight_quant, name=name)

        flat_expert = chosen.reshape(-1)
        order = jnp.argsort(flat_expert, stable=True)
        token = (jnp.arange(num_tokens * top_k, dtype=jnp.int32) // top_k)[order]
        group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
        rows = x[token]
        act = activation(cfg.hidden_act)
        h = (act(experts(inter, "experts_gate_proj", "column")(rows, group_sizes))
             * experts(inter, "experts_up_proj", "column")(rows, group_sizes))
        y = (experts(hidden, "experts_down_proj", "row")(h, group_sizes).astype(jnp.float32)
             * weights.reshape(-1)[order][:, None])
        out = jnp.zeros((num_tokens, hidden), jnp.float32).at[token].add(y).astype(self.dtype)

        if cfg.shared_expert_intermediate_size:
            shared = GatedMLP(cfg, self.dtype, intermediate_size=cfg.shared_expert_intermediate_size,
                              linear_backend=self.linear_backend, name="shared_expert")(x, live_rows)
            gate = Linear(1, self.dtype, backend=self.linear_backend, name="shared_expert_gate")
            out = out + jax.nn.sigmoid(gate(x, live_rows)) * shared
        return out
