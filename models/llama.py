"""Flax Llama family: Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3 (one decoder; differences live in ModelConfig
and, for Phi-3's fused projections, in the loader).

The parameter tree mirrors Hugging Face names, with the decoder layers stacked on a leading axis so the
forward pass scans over layers (one layer is compiled instead of L: start-up time matters):

    embed_tokens/embedding            [V, H]
    layers/input_layernorm/scale      [L, H]
    layers/self_attn/{q,k,v,o}_proj/{kernel [L, in, out], bias [L, out]}
    layers/self_attn/{q,k}_norm/scale [L, head_dim]   (Qwen3)
    layers/post_attention_layernorm/scale
    layers/mlp/{gate,up,down}_proj/kernel
    norm/scale                        [H]
    lm_head/kernel                    [H, V]   (absent when embeddings are tied)
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.attention import AttentionMetadata
from models.config import ModelConfig
from models.layers import GatedMLP, PagedSelfAttention, RMSNorm, rotary_cos_sin


class DecoderLayer(nn.Module):
    config: ModelConfig
    dtype: Any

    @nn.compact
    def __call__(self, h, cos, sin, k_cache, v_cache, layer, meta, attention):
        cfg = self.config
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, name="input_layernorm")(h)
        x, k_cache, v_cache = PagedSelfAttention(cfg, self.dtype, name="self_attn")(
            x, cos, sin, k_cache, v_cache, layer, meta, attention)
        h = h + x
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, name="post_attention_layernorm")(h)
        h = h + GatedMLP(cfg, self.dtype, name="mlp")(x)
        return h, k_cache, v_cache


class LlamaForCausalLM:
    """Functional causal LM over a paged KV cache.

    `forward(params, kv_cache, token_ids, meta, logits_indices)` returns logits float32 [S, V] for the
    tokens picked by `logits_indices` (only those reach the LM head) and the updated cache.
    """

    def __init__(self, config: ModelConfig, dtype: Any):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.layer = DecoderLayer(config, self.dtype)
        self.final_norm = RMSNorm(config.rms_norm_eps, self.dtype)
        self.inv_freq = config.rope.inv_freq(config.head_dim)

    def layer_param_shapes(self) -> dict:
        """Shapes of one decoder layer's parameters, from Flax's own init (used to validate checkpoints)."""
        cfg = self.config
        h = jnp.zeros((1, cfg.hidden_size), self.dtype)
        cos = jnp.zeros((1, cfg.head_dim), jnp.float32)
        kv = jnp.zeros((1, cfg.num_kv_heads, 2, 1, cfg.head_dim), self.dtype)
        meta = AttentionMetadata(*(jnp.zeros(s, jnp.int32) for s in [(1,), (1,), (1,), (1, 1), (2,), (1,)]),
                                 tail_split=jnp.zeros((), bool), tail_prefix_seq=jnp.zeros((), jnp.int32),
                                 tail_prefix_len=jnp.zeros((), jnp.int32))
        from models.attention import ReferenceAttention
        shapes = jax.eval_shape(lambda: self.layer.init(jax.random.key(0), h, cos, cos, kv, kv, 0, meta,
                                                        ReferenceAttention()))
        return shapes["params"]

    def forward(self, params, kv_cache, token_ids, meta: AttentionMetadata, logits_indices, attention):
        """
        Args:
          params: the tree described in the module docstring.
          kv_cache: (k, v), each [L, num_kv_heads, num_blocks, block_size, head_dim].
          token_ids: int32 [T]; the step's packed new tokens.
          meta: AttentionMetadata for the step.
          logits_indices: int32 [S]; which packed token's hidden state feeds each sequence's logits.
          attention: the attention backend.
        Returns:
          (logits float32 [S, V], kv_cache)
        """
        cfg = self.config
        embed = params["embed_tokens"]["embedding"]
        h = embed[token_ids].astype(self.dtype)
        cos, sin = rotary_cos_sin(meta.positions, self.inv_freq)
        k_all, v_all = kv_cache

        def one_layer(carry, xs):
            h, k_all, v_all = carry
            layer_params, index = xs
            # The whole pool rides in the scan carry and each layer scatters into it, so with the pool
            # donated the update happens in place (no per-layer copies).
            h, k_all, v_all = self.layer.apply({"params": layer_params}, h, cos, sin, k_all, v_all, index,
                                               meta, attention)
            return (h, k_all, v_all), None

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (h, k_all, v_all), _ = jax.lax.scan(one_layer, (h, k_all, v_all), (params["layers"], layer_ids))
        h = h[logits_indices]
        h = self.final_norm.apply({"params": params["norm"]}, h)
        if cfg.tie_word_embeddings:
            logits = jnp.einsum("sh,vh->sv", h, embed, preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("sh,hv->sv", h, params["lm_head"]["kernel"], preferred_element_type=jnp.float32)
        return logits, (k_all, v_all)
