"""An EAGLE head (EAGLE-1, as vLLM loads it for method "eagle"): one Llama decoder layer that predicts the
target's next final hidden state from its current one and the next token's embedding.

    fc/kernel                     [2H, H]     the fused input: concat(embedding of token p + 1, target feature at p)
    layers/self_attn/{q,k,v,o}_proj/kernel, layers/post_attention_layernorm/scale, layers/mlp/{gate,up,down}_proj
                                  (one layer, without input_layernorm)

Checkpoints (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B) name these `fc.weight` and `layers.0.*` (with or without a
`model.` prefix); an `embed_tokens.weight` or `lm_head.weight` they carry is not read: the head uses the
target's embedding table and LM head. The feature is the target's final-normed hidden state; the head's output
(residual stream after the layer, no final norm) goes through the target's LM head to give the proposal, and
is the feature of the next position while the head drafts on its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged.models.attention import AttentionMetadata
from paged.models.config import ModelConfig, load_model_config
from paged.models.layers import rotary_cos_sin, run_layers
from paged.models.linear import LastHidden, Linear
from paged.models.llama import DecoderLayer, LlamaForCausalLM
from paged.models.loader import load_params, resolve_model_path


class EagleHead(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, dtype: Any, linear_backend: str = "xla"):
        if config.num_layers != 1:
            raise ValueError(f"an EAGLE head has one decoder layer; this checkpoint's config has {config.num_layers}")
        if config.rope.length_dependent or config.local_rope:
            raise NotImplementedError("EAGLE heads with a length-dependent or per-layer rope are not supported")
        super().__init__(config, dtype, linear_backend)
        self.layer = DecoderLayer(config, self.dtype, linear_backend, input_norm=False)
        self.fc = Linear(config.hidden_size, self.dtype, backend=linear_backend)

    def global_params(self) -> dict:
        h2 = jnp.zeros((1, 2 * self.config.hidden_size), self.dtype)
        return {"fc": jax.eval_shape(lambda: self.fc.init(jax.random.key(0), h2))["params"]}

    def checkpoint_target(self, name: str):
        name = name.removeprefix("model.")
        if name == "fc.weight":
            return ("fc", "kernel"), None, True
        if name.startswith("layers.0.input_layernorm."):
            return None  # EAGLE-1's first layer has none (vLLM skips it too)
        if name.startswith("layers."):
            return super().checkpoint_target("model." + name)
        return None  # embed_tokens, lm_head, norm: the target's are used

    def hidden_states(self, params, kv_cache, token_ids, meta: AttentionMetadata, rows, attention, *,
                      features, target, target_params):
        """The head's output at the packed tokens `rows` picks (int32 [S]) and the updated cache.

        Args:
          token_ids: int32 [T]; the token after each position (position p reads token p + 1).
          features: [T, H] in the model dtype; the feature at each position (the target's final-normed hidden
            state, or the head's own output while it drafts).
          target, target_params: the target model and its parameters (its embedding table).
        Returns:
          ([S, H] outputs, the residual stream with no final norm, kv_cache)
        """
        cfg = self.config
        embedded = target.embed.apply({"params": target_params["embed_tokens"]}, token_ids).astype(self.dtype)
        h = self.fc.apply({"params": params["fc"]},
                          jnp.concatenate([embedded, features.astype(self.dtype)], axis=-1))
        cos, sin = rotary_cos_sin(meta.positions, self.inv_freq, cfg.rotary_interleaved,
                                  params.get("rotary", {}).get("global"), self.rope_scaling)
        live_tokens = meta.query_start[-1]

        def one_layer(carry, xs):
            h, delta, k_all, v_all = carry
            layer_params, index, window = xs
            return self.layer.apply({"params": layer_params}, h, delta, cos, sin, k_all, v_all, index, window, meta,
                                    attention, live_tokens)

        k_all, v_all = kv_cache
        window = jnp.asarray(cfg.layer_windows or (0,), jnp.int32)
        h, delta, k_all, v_all = run_layers(one_layer, (h, jnp.zeros_like(h), k_all, v_all), params["layers"],
                                            (jnp.zeros(1, jnp.int32), window))
        return (h + delta)[rows], (k_all, v_all)

    def head_logits(self, target, target_params, outputs: jax.Array, live_rows) -> jax.Array:
        """float32 [S, V]: the target's LM head on the head's outputs."""
        return target.logits(target_params, LastHidden(outputs.astype(target.dtype), live_rows))


def load_eagle_head(model: str, target_config: ModelConfig, dtype, linear_backend: str, show_progress: bool = False
                    ) -> tuple[ModelConfig, EagleHead, dict]:
    """(config, head, params) of the EAGLE checkpoint `model` (a directory or hub id) for the target whose
    config is `target_config`: its features are the target's hidden states, so the widths must agree."""
    model_dir = resolve_model_path(model)
    config = load_model_config(model_dir)
    if config.hidden_size != target_config.hidden_size:
        raise ValueError(f"speculative_config: the EAGLE head {model!r} has hidden size {config.hidden_size}, the "
                         f"target {target_config.hidden_size}; a head reads the target's hidden states")
    # Its embedding and LM head are the target's: the vocabulary is the target's.
    config = dataclasses.replace(config, vocab_size=target_config.vocab_size,
                                 padded_vocab_size=target_config.padded_vocab_size)
    head = EagleHead(config, dtype, linear_backend)
    params = load_params(model_dir, head, config, np.dtype(dtype), show_progress, stacked_layers=False)
    return config, head, params
