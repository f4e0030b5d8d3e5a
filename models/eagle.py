"""EAGLE heads, as vLLM loads them: EAGLE-1 (method "eagle") and EAGLE-3 (method "eagle3").

EAGLE-1: one Llama decoder layer that predicts the target's next final hidden state from its current one and
the next token's embedding.

    fc/kernel                     [2H, H]     the fused input: concat(embedding of token p + 1, target feature at p)
    layers/self_attn/{q,k,v,o}_proj/kernel, layers/post_attention_layernorm/scale, layers/mlp/{gate,up,down}_proj
                                  (one layer, without input_layernorm)

Checkpoints (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B) name these `fc.weight` and `layers.0.*` (with or without a
`model.` prefix); an `embed_tokens.weight` or `lm_head.weight` they carry is not read: the head uses the
target's embedding table and LM head. The feature is the target's final-normed hidden state; the head's output
(residual stream after the layer, no final norm) goes through the target's LM head to give the proposal, and
is the feature of the next position while the head drafts on its own.

EAGLE-3 (`Eagle3Head`): the feature is three of the target's intermediate residual streams, concatenated and
projected by `fc` [3 H_target, H]; the layer's attention reads concat(input_layernorm(embedding),
hidden_norm(feature)) [2H]; the head has its own final norm and an LM head over a smaller draft vocabulary,
whose ids map to the target's by `d2t` (target id = draft id + d2t[draft id]). Its output before the final
norm is the next position's feature while it drafts on its own (no fc then: it is already H wide).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from paged.models.attention import AttentionMetadata
from paged.models.config import ModelConfig, load_model_config
from paged.models.layers import Block, GatedMLP, PagedSelfAttention, RMSNorm, rotary_cos_sin, run_layers
from paged.models.linear import LastHidden, Linear
from paged.models.llama import DecoderLayer, LlamaForCausalLM
from paged.models.loader import load_params, resolve_model_path
from paged.sampler import first_argmax


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

    def combine(self, params, features: jax.Array) -> jax.Array:
        """The target's stored features as the head reads them (EAGLE-1: as they are)."""
        return features

    def propose(self, params, target, target_params, outputs: jax.Array) -> jax.Array:
        """int32 [S]: the greedy token after each of the head's outputs, by the target's LM head."""
        return first_argmax(target.logits(target_params, LastHidden(outputs.astype(target.dtype),
                                                                    jnp.int32(outputs.shape[0]))))


def load_eagle_head(model: str, target_config: ModelConfig, dtype, linear_backend: str, show_progress: bool = False
                    ) -> tuple[ModelConfig, EagleHead, dict]:
    """(config, head, params) of the EAGLE checkpoint `model` (a directory or hub id) for the target whose
    config is `target_config`: its features are the target's hidden states, so the widths must agree."""
    model_dir = resolve_model_path(model)
    config = head_config(model_dir, "eagle")
    if config.hidden_size != target_config.hidden_size:
        raise ValueError(f"speculative_config: the EAGLE head {model!r} has hidden size {config.hidden_size}, the "
                         f"target {target_config.hidden_size}; a head reads the target's hidden states")
    # Its embedding and LM head are the target's: the vocabulary is the target's.
    config = dataclasses.replace(config, vocab_size=target_config.vocab_size,
                                 padded_vocab_size=target_config.padded_vocab_size)
    head = EagleHead(config, dtype, linear_backend)
    params = load_params(model_dir, head, config, np.dtype(dtype), show_progress, stacked_layers=False)
    return config, head, params


# ---- EAGLE-3 ------------------------------------------------------------------------------------------------

class Eagle3Layer(Block):
    """EAGLE-3's decoder layer: attention reads concat(input_layernorm(embedding), hidden_norm(feature)) [2H];
    the residual stream is the feature, before its norm (after it, with `norm_before_residual`).
    Returns (residual stream after attention, the MLP's output, k_cache, v_cache), as DecoderLayer does."""

    norm_before_residual: bool = False

    @nn.compact
    def __call__(self, embedded, feature, cos, sin, k_cache, v_cache, layer, window, meta, attention,
                 live_rows=None):
        cfg = self.config
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.norm_plus_one, self.linear_backend, name=name)
        normed_feature = norm("hidden_norm")(feature)
        residual = normed_feature if self.norm_before_residual else feature
        x = jnp.concatenate([norm("input_layernorm")(embedded), normed_feature], axis=-1)
        x, k_cache, v_cache = PagedSelfAttention(cfg, self.dtype, self.linear_backend, name="self_attn")(
            x, cos, sin, k_cache, v_cache, layer, window, meta, attention, live_rows)
        h, x = norm("post_attention_layernorm")(residual, x)
        return h, GatedMLP(cfg, self.dtype, linear_backend=self.linear_backend, name="mlp")(x, live_rows), \
            k_cache, v_cache


@dataclasses.dataclass(frozen=True)
class Eagle3Spec:
    """What an EAGLE-3 checkpoint's config.json says beyond a Llama layer's shape."""
    draft_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool
    aux_layer_ids: tuple[int, ...] | None  # None: the target's default (`eagle3_aux_layers`)


def _eagle3_raw_config(model_dir: str) -> dict:
    """The checkpoint's config.json flattened: the speculators format (architectures ["Eagle3Speculator"])
    nests the layer's Llama config under `transformer_layer_config`; EAGLE-3's own format
    (["LlamaForCausalLMEagle3"]) is one flat Llama config."""
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    layer = raw.get("transformer_layer_config")
    return {**raw, **layer} if isinstance(layer, dict) else raw


def eagle3_spec(model_dir: str) -> Eagle3Spec:
    raw = _eagle3_raw_config(model_dir)
    eagle = raw.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise NotImplementedError("speculative_config: an EAGLE-3 head without auxiliary hidden states "
                                  "(eagle_config.use_aux_hidden_state false) is not supported")
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    return Eagle3Spec(draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
                      target_hidden_size=int(raw.get("target_hidden_size") or raw["hidden_size"]),
                      norm_before_residual=bool(raw.get("norm_before_residual", False)),
                      aux_layer_ids=tuple(int(i) for i in ids) if ids else None)


def eagle3_aux_layers(model: str, target_num_layers: int) -> tuple[int, ...]:
    """Which of the target's residual streams the head `model` reads: id j is the stream entering layer j
    (0: the embedding), as vLLM numbers them; the checkpoint's `eagle_aux_hidden_state_layer_ids`, else
    vLLM's default for a Llama-family target, (2, L // 2, L - 3)."""
    spec = eagle3_spec(resolve_model_path(model))
    ids = spec.aux_layer_ids or (2, target_num_layers // 2, target_num_layers - 3)
    if len(ids) != 3 or not all(0 <= i < target_num_layers for i in ids):
        where = "its eagle_aux_hidden_state_layer_ids" if spec.aux_layer_ids else "the default (2, L // 2, L - 3)"
        raise ValueError(f"speculative_config: the EAGLE-3 head {model!r} reads the target's layers {list(ids)} "
                         f"({where}); it needs three ids in [0, {target_num_layers}) for this "
                         f"{target_num_layers}-layer target")
    return tuple(ids)


class Eagle3Head(LlamaForCausalLM):
    """An EAGLE-3 head; the interface is EagleHead's (`combine`, `hidden_states`, `propose`).

    Parameters: fc/kernel [3 H_target, H]; layers: one Eagle3Layer (self_attn q/k/v kernels read 2H);
    norm/scale [H]; lm_head/kernel [H, draft vocab]; d2t int32 [draft vocab] (loaded apart); embed_tokens
    only when the checkpoint carries one (else the target's is read)."""

    def __init__(self, config: ModelConfig, spec: Eagle3Spec, dtype: Any, linear_backend: str = "xla"):
        if config.num_layers != 1:
            raise NotImplementedError(f"EAGLE-3 heads of {config.num_layers} layers are not supported (one is)")
        if config.rope.length_dependent or config.local_rope:
            raise NotImplementedError("EAGLE heads with a length-dependent or per-layer rope are not supported")
        super().__init__(config, dtype, linear_backend)
        self.spec = spec
        self.layer = Eagle3Layer(config, self.dtype, linear_backend, norm_before_residual=spec.norm_before_residual)
        self.fc = Linear(config.hidden_size, self.dtype, backend=linear_backend)
        self.lm_head = Linear(spec.draft_vocab_size, self.dtype, backend=linear_backend, out_dtype=jnp.float32)

    def global_params(self) -> dict:
        key = jax.random.key(0)
        init = lambda module, width: jax.eval_shape(
            lambda: module.init(key, jnp.zeros((1, width), self.dtype)))["params"]
        h = self.config.hidden_size
        return {"fc": init(self.fc, 3 * self.spec.target_hidden_size), "norm": init(self.final_norm, h),
                "lm_head": init(self.lm_head, h)}

    def checkpoint_target(self, name: str):
        """EAGLE-3's names (`midlayer.*`) and the speculators format's (`layers.0.*`); d2t, t2d and
        embed_tokens are read apart (`load_eagle3_head`)."""
        name = name.removeprefix("model.")
        if name == "fc.weight":
            return ("fc", "kernel"), None, True
        if name == "norm.weight":
            return ("norm", "scale"), None, False
        if name == "lm_head.weight":
            return ("lm_head", "kernel"), None, True
        for prefix in ("midlayer.", "layers.0."):
            if name.startswith(prefix):
                return super().checkpoint_target("model.layers.0." + name[len(prefix):])
        return None

    def combine(self, params, features: jax.Array) -> jax.Array:
        """[T, H]: fc over the target's three streams [T, 3 H_target]."""
        return self.fc.apply({"params": params["fc"]}, features.astype(self.dtype))

    def hidden_states(self, params, kv_cache, token_ids, meta: AttentionMetadata, rows, attention, *,
                      features, target, target_params):
        """As EagleHead's: ([S, H] outputs before the final norm, the next positions' features; kv_cache)."""
        cfg = self.config
        embed, table = (self.embed, params["embed_tokens"]) if "embed_tokens" in params else \
            (target.embed, target_params["embed_tokens"])
        embedded = embed.apply({"params": table}, token_ids).astype(self.dtype)
        cos, sin = rotary_cos_sin(meta.positions, self.inv_freq, cfg.rotary_interleaved,
                                  params.get("rotary", {}).get("global"), self.rope_scaling)
        layer_params = params["layers"][0] if isinstance(params["layers"], (list, tuple)) else \
            jax.tree.map(lambda leaf: leaf[0], params["layers"])
        k_all, v_all = kv_cache
        h, delta, k_all, v_all = self.layer.apply(
            {"params": layer_params}, embedded, features.astype(self.dtype), cos, sin, k_all, v_all,
            jnp.int32(0), jnp.int32(0), meta, attention, meta.query_start[-1])
        return (h + delta)[rows], (k_all, v_all)

    def propose(self, params, target, target_params, outputs: jax.Array) -> jax.Array:
        """int32 [S]: the argmax of the head's own LM head over the draft vocabulary, as a target id."""
        normed = self.final_norm.apply({"params": params["norm"]}, outputs)
        best = first_argmax(self.lm_head.apply({"params": params["lm_head"]}, normed))
        return best + jnp.take(params["d2t"], best)


def _read_optional(model_dir: str, names: tuple[str, ...]) -> np.ndarray | None:
    """The first of `names` any of the checkpoint's safetensors files holds, else None."""
    for file in sorted(os.listdir(model_dir)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, file), framework="np") as f:
                for name in names:
                    if name in f.keys():
                        return f.get_tensor(name)
    return None


def head_config(model_dir: str, method: str) -> ModelConfig:
    """The head's layer shape as a ModelConfig (method "eagle" or "eagle3"; an EAGLE-3 config read as the
    Llama layer it describes)."""
    if method == "eagle":
        return load_model_config(model_dir)
    raw = _eagle3_raw_config(model_dir)
    overrides = {key: raw[key] for key in raw if key not in ("architectures", "transformer_layer_config")}
    return load_model_config(model_dir, {**overrides, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def load_eagle3_head(model: str, target_config: ModelConfig, dtype, linear_backend: str,
                     show_progress: bool = False) -> tuple[ModelConfig, Eagle3Head, dict]:
    """(config, head, params) of the EAGLE-3 checkpoint `model` for the target whose config is
    `target_config`."""
    model_dir = resolve_model_path(model)
    spec = eagle3_spec(model_dir)
    config = head_config(model_dir, "eagle3")
    if spec.target_hidden_size != target_config.hidden_size:
        raise ValueError(f"speculative_config: the EAGLE-3 head {model!r} reads features of width "
                         f"{spec.target_hidden_size}, the target's hidden size is {target_config.hidden_size}")
    if config.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config: the EAGLE-3 head {model!r} is for a vocabulary of "
                         f"{config.vocab_size} tokens, the target has {target_config.vocab_size}")
    config = dataclasses.replace(config, padded_vocab_size=target_config.padded_vocab_size)
    head = Eagle3Head(config, spec, dtype, linear_backend)
    params = load_params(model_dir, head, config, np.dtype(dtype), show_progress, stacked_layers=False)
    d2t = _read_optional(model_dir, ("d2t", "model.d2t"))
    if d2t is None:
        if spec.draft_vocab_size != config.vocab_size:
            raise ValueError(f"speculative_config: the EAGLE-3 head {model!r} has a draft vocabulary of "
                             f"{spec.draft_vocab_size} tokens and no d2t mapping to the target's")
        d2t = np.zeros(spec.draft_vocab_size, np.int64)
    if d2t.shape != (spec.draft_vocab_size,):
        raise ValueError(f"speculative_config: the EAGLE-3 head {model!r} has d2t of shape {d2t.shape}; its "
                         f"draft vocabulary is {spec.draft_vocab_size}")
    targets = np.arange(spec.draft_vocab_size) + d2t
    if targets.min() < 0 or targets.max() >= config.vocab_size:
        raise ValueError(f"speculative_config: the EAGLE-3 head {model!r} maps draft ids outside the target's "
                         f"vocabulary of {config.vocab_size} (d2t)")
    params["d2t"] = jnp.asarray(d2t, jnp.int32)
    embedding = _read_optional(model_dir, ("embed_tokens.weight", "model.embed_tokens.weight"))
    if embedding is not None:
        if embedding.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(f"speculative_config: the EAGLE-3 head {model!r} has embed_tokens of shape "
                             f"{embedding.shape}, not ({config.vocab_size}, {config.hidden_size})")
        params["embed_tokens"] = {"embedding": jnp.asarray(embedding, dtype)}
    elif config.hidden_size != target_config.hidden_size:
        raise ValueError(f"speculative_config: the EAGLE-3 head {model!r} carries no embed_tokens and its hidden "
                         f"size {config.hidden_size} is not the target's {target_config.hidden_size}")
    return config, head, params
