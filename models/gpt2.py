"""Flax GPT-2: learned positions, pre-LayerNorm blocks, fused qkv (Conv1D weights are already [in, out]).

Parameter tree (layers stacked on a leading axis, as for the Llama family):

    wte/embedding [V, H]   wpe/embedding [n_positions, H]   ln_f/{scale, bias}
    layers/ln_1, layers/ln_2: {scale, bias} [L, H]
    layers/attn/c_attn/{kernel [L, H, 3H], bias}   layers/attn/c_proj/{kernel [L, H, H], bias}
    layers/mlp/c_fc/{kernel [L, H, I], bias}      layers/mlp/c_proj/{kernel [L, I, H], bias}
"""

from __future__ import annotations

import re
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from paged.models.attention import AttentionMetadata, ReferenceAttention
from paged.models.config import ModelConfig
from paged.models.layers import Block, activation, run_layers
from paged.models.linear import GREEDY_SCREEN, Embedding, LastHidden, Linear, tied_greedy_head, tied_head_screen


class GPT2Block(Block):
    @nn.compact
    def __call__(self, h, k_cache, v_cache, layer, meta, attention, live_rows=None):
        cfg = self.config
        norm = lambda name: nn.LayerNorm(epsilon=cfg.rms_norm_eps, dtype=self.dtype, param_dtype=self.dtype,
                                         name=name)
        out, k_cache, v_cache = _Attention(cfg, self.dtype, self.linear_backend, name="attn")(
            norm("ln_1")(h), k_cache, v_cache, layer, meta, attention, live_rows)
        h = h + out
        h = h + _MLP(cfg, self.dtype, self.linear_backend, name="mlp")(norm("ln_2")(h), live_rows)
        return h, k_cache, v_cache


class _Attention(Block):
    """c_attn's fused q|k|v columns are not split for tensor parallelism (a shard would hold a slice of q and
    none of k and v), so it is replicated; c_proj is row-parallel."""

    @nn.compact
    def __call__(self, x, k_cache, v_cache, layer, meta, attention, live_rows=None):
        cfg = self.config
        num_tokens = x.shape[0]
        linear = lambda n, name, parallel: Linear(n, self.dtype, True, parallel, self.linear_backend, name=name)
        qkv = linear(3 * cfg.hidden_size, "c_attn", "replicated")(x, live_rows)
        q, k, v = (part.reshape(num_tokens, cfg.num_heads, cfg.head_dim) for part in jnp.split(qkv, 3, axis=-1))
        k_cache, v_cache = attention.write_kv(k_cache, v_cache, layer, k, v, meta)
        out = attention.attend(q, k, v, k_cache, v_cache, layer, meta, scale=cfg.head_dim ** -0.5)
        out = linear(cfg.hidden_size, "c_proj", "row")(out.reshape(num_tokens, cfg.hidden_size), live_rows)
        return out, k_cache, v_cache


class _MLP(Block):
    @nn.compact
    def __call__(self, x, live_rows=None):
        cfg = self.config
        linear = lambda n, name, parallel: Linear(n, self.dtype, True, parallel, self.linear_backend, name=name)
        x = linear(cfg.intermediate_size, "c_fc", "column")(x, live_rows)
        return linear(cfg.hidden_size, "c_proj", "row")(activation(cfg.hidden_act)(x), live_rows)


class GPT2LMHeadModel:
    """Functional GPT-2 over the paged KV cache; same interface as LlamaForCausalLM."""

    _LAYER_RE = re.compile(r"^(?:transformer\.)?h\.(\d+)\.(.+)\.(weight|bias)$")

    def __init__(self, config: ModelConfig, dtype: Any, linear_backend: str = "xla"):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.block = GPT2Block(config, self.dtype, linear_backend)
        self.final_norm = nn.LayerNorm(epsilon=config.rms_norm_eps, dtype=self.dtype, param_dtype=self.dtype)
        self.wte = Embedding(config.vocab_rows, config.hidden_size, self.dtype, backend=linear_backend)
        self.wpe = Embedding(config.max_position_embeddings, config.hidden_size, self.dtype, vocab_parallel=False)

    def global_params(self) -> dict:
        """See LlamaForCausalLM.global_params."""
        c = self.config
        key = jax.random.key(0)
        ids = jnp.zeros((1,), jnp.int32)
        init = lambda module, x: jax.eval_shape(lambda: module.init(key, x))["params"]
        return {"wte": init(self.wte, ids), "wpe": init(self.wpe, ids),
                "ln_f": init(self.final_norm, jnp.zeros((1, c.hidden_size), self.dtype))}

    def checkpoint_target(self, name: str):
        name = name.removeprefix("transformer.")
        if name in ("wte.weight", "wpe.weight"):
            return (name.split(".")[0], "embedding"), None, False
        if name in ("ln_f.weight", "ln_f.bias"):
            return ("ln_f", "scale" if name.endswith("weight") else "bias"), None, False
        match = self._LAYER_RE.match(name)
        if not match:
            return None  # lm_head (tied to wte) and legacy attention-mask buffers
        layer, module, kind = int(match.group(1)), match.group(2), match.group(3)
        parts = tuple(module.split("."))
        if parts[-1].startswith("ln_"):
            return ("layers", *parts, "scale" if kind == "weight" else "bias"), layer, False
        # Conv1D stores [in, out], which is already Dense's kernel layout.
        return ("layers", *parts, "kernel" if kind == "weight" else "bias"), layer, False

    def split_fused(self, name: str, f):
        yield name, lambda: f.get_tensor(name)

    def layer_params(self) -> dict:
        cfg = self.config
        h = jnp.zeros((1, cfg.hidden_size), self.dtype)
        kv = jnp.zeros((1, cfg.num_kv_heads, 2, 1, cfg.head_dim), self.dtype)
        meta = AttentionMetadata.placeholder()
        shapes = jax.eval_shape(lambda: self.block.init(jax.random.key(0), h, kv, kv, 0, meta, ReferenceAttention()))
        return shapes["params"]

    def precomputed(self, max_positions: int) -> dict:
        """Nothing: GPT-2's positions are a learned table among the weights."""
        del max_positions
        return {}

    def hidden_states(self, params, kv_cache, token_ids, meta: AttentionMetadata, logits_indices, attention):
        """See LlamaForCausalLM.hidden_states."""
        h = (params["wte"]["embedding"][token_ids] + params["wpe"]["embedding"][meta.positions]).astype(self.dtype)
        live_tokens = meta.query_start[-1]  # rows from it on are padding (see LlamaForCausalLM.forward)

        def one_layer(carry, xs):
            h, k_all, v_all = carry
            layer_params, index = xs
            return self.block.apply({"params": layer_params}, h, k_all, v_all, index, meta, attention, live_tokens)

        layer_ids = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        h, k_all, v_all = run_layers(one_layer, (h, *kv_cache), params["layers"], (layer_ids,))
        h = self.final_norm.apply({"params": params["ln_f"]}, h[logits_indices])
        return LastHidden(h, jnp.sum(meta.seq_lens > 0, dtype=jnp.int32)), (k_all, v_all)

    def logits(self, params, last: LastHidden) -> jax.Array:
        """float32 logits [S, V] against the tied token table."""
        logits = self.wte.apply({"params": params["wte"]}, last.h, last.live_rows, method="attend")
        if self.config.padded_vocab_size:
            logits = logits[:, :self.config.vocab_size]  # the padding rows are not tokens
        return logits

    def greedy_head(self, params, last: LastHidden) -> Callable[[], jax.Array] | None:
        """See LlamaForCausalLM.greedy_head (GPT-2's LM head is always the token table)."""
        return tied_greedy_head(self.wte, params["wte"], last, self.config, params.get(GREEDY_SCREEN))

    def head_screen(self, params) -> dict:
        """See LlamaForCausalLM.head_screen."""
        return tied_head_screen(self.wte, params["wte"], self.config)

    def forward(self, params, kv_cache, token_ids, meta: AttentionMetadata, logits_indices, attention):
        """See LlamaForCausalLM.forward."""
        last, kv_cache = self.hidden_states(params, kv_cache, token_ids, meta, logits_indices, attention)
        return self.logits(params, last), kv_cache
