"""A model of a user's own, written against paged's model contract (models/base.py) and registered on import:
a pre-LayerNorm decoder with learned positions and a GELU MLP, unlike any built-in family. `write_checkpoint`
makes a random one; `reference_greedy` decodes it with a float64 numpy forward pass (no paging, no batching)."""

from __future__ import annotations

import json
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import paged
from paged.models.attention import ReferenceAttention
from paged.models.layers import run_layers
from paged.models.linear import Embedding, LastHidden, Linear

ARCHITECTURE = "TinyUserLM"
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256)


class Block(nn.Module):
    config: Any
    dtype: Any
    backend: str = "xla"

    @nn.compact
    def __call__(self, h, k_cache, v_cache, layer, meta, attention):
        cfg = self.config
        tokens = h.shape[0]
        norm = lambda name: nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, param_dtype=self.dtype, name=name)
        linear = lambda n, name, parallel: Linear(n, self.dtype, True, parallel, self.backend, name=name)
        x = norm("ln1")(h)
        q = linear(cfg.q_size, "q", "column")(x).reshape(tokens, cfg.num_heads, cfg.head_dim)
        k = linear(cfg.kv_size, "k", "column")(x).reshape(tokens, cfg.num_kv_heads, cfg.head_dim)
        v = linear(cfg.kv_size, "v", "column")(x).reshape(tokens, cfg.num_kv_heads, cfg.head_dim)
        k_cache, v_cache = attention.write_kv(k_cache, v_cache, layer, k, v, meta)
        out = attention.attend(q, k, v, k_cache, v_cache, layer, meta, scale=cfg.head_dim ** -0.5)
        h = h + linear(cfg.hidden_size, "o", "row")(out.reshape(tokens, cfg.q_size))
        x = jax.nn.gelu(linear(cfg.intermediate_size, "up", "column")(norm("ln2")(h)), approximate=False)
        return h + linear(cfg.hidden_size, "down", "row")(x), k_cache, v_cache


class TinyUserLM(paged.PagedModel):
    weight_names = {
        r"embed\.weight": "embed/embedding",
        r"pos\.weight": "pos/embedding",
        r"final_norm\.weight": "final_norm/scale",
        r"final_norm\.bias": "final_norm/bias",
        r"lm_head\.weight": "lm_head/kernel",
        r"layers\.(\d+)\.(ln1|ln2)\.weight": r"layers/\2/scale",
        r"layers\.(\d+)\.(ln1|ln2)\.bias": r"layers/\2/bias",
        r"layers\.(\d+)\.(q|k|v|o|up|down)\.weight": r"layers/\2/kernel",
        r"layers\.(\d+)\.(q|k|v|o|up|down)\.bias": r"layers/\2/bias",
    }

    def __init__(self, config, dtype, linear_backend: str = "xla"):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.block = Block(config, self.dtype, linear_backend)
        self.embed = Embedding(config.vocab_size, config.hidden_size, self.dtype)
        self.pos = Embedding(config.max_position_embeddings, config.hidden_size, self.dtype, vocab_parallel=False)
        self.final_norm = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, param_dtype=self.dtype)
        self.lm_head = Linear(config.vocab_size, self.dtype, parallel="column", out_dtype=jnp.float32)

    def global_params(self):
        h, ids = jnp.zeros((1, self.config.hidden_size), self.dtype), jnp.zeros((1,), jnp.int32)
        init = lambda module, x: jax.eval_shape(lambda: module.init(jax.random.key(0), x))["params"]
        return {"embed": init(self.embed, ids), "pos": init(self.pos, ids), "final_norm": init(self.final_norm, h),
                "lm_head": init(self.lm_head, h)}

    def layer_params(self):
        cfg = self.config
        h = jnp.zeros((1, cfg.hidden_size), self.dtype)
        kv = jnp.zeros((1, cfg.num_kv_heads, 2, 1, cfg.head_dim), self.dtype)
        meta = paged.AttentionMetadata.placeholder()
        return jax.eval_shape(lambda: self.block.init(jax.random.key(0), h, kv, kv, 0, meta,
                                                      ReferenceAttention()))["params"]

    def hidden_states(self, params, kv_cache, token_ids, meta, logits_indices, attention):
        h = params["embed"]["embedding"][token_ids] + params["pos"]["embedding"][meta.positions]

        def one_layer(carry, xs):
            h, k_all, v_all = carry
            layer_params, index = xs
            return self.block.apply({"params": layer_params}, h, k_all, v_all, index, meta, attention)

        layers = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        h, k_all, v_all = run_layers(one_layer, (h.astype(self.dtype), *kv_cache), params["layers"], (layers,))
        h = self.final_norm.apply({"params": params["final_norm"]}, h[logits_indices])
        return LastHidden(h, jnp.sum(meta.seq_lens > 0, dtype=jnp.int32)), (k_all, v_all)

    def logits(self, params, last):
        return self.lm_head.apply({"params": params["lm_head"]}, last.h)


paged.register_model(ARCHITECTURE, TinyUserLM)


# ---- a random checkpoint, and its float64 reference ------------------------------------------------------


def write_checkpoint(directory: str, seed: int = 0) -> str:
    """config.json, model.safetensors (PyTorch's [out, in] linear layout) and a tokenizer."""
    from safetensors.numpy import save_file

    from paged.models.tiny import _train_tokenizer
    os.makedirs(directory, exist_ok=True)
    vocab = _train_tokenizer(directory, 512)
    config = {"architectures": [ARCHITECTURE], "model_type": "tiny_user", "vocab_size": vocab,
              "eos_token_id": 1, "bos_token_id": 0, "torch_dtype": "float32", **SHAPE}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    rng = np.random.default_rng(seed)
    normal = lambda *shape, scale=0.3: (rng.standard_normal(shape) * scale).astype(np.float32)
    hidden, inner = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    tensors = {"embed.weight": normal(vocab, hidden), "pos.weight": normal(SHAPE["max_position_embeddings"], hidden),
               "final_norm.weight": 1 + normal(hidden, scale=0.1), "final_norm.bias": normal(hidden, scale=0.1),
               "lm_head.weight": normal(vocab, hidden)}
    for i in range(SHAPE["num_hidden_layers"]):
        for name, (out, inp) in {"q": (hidden, hidden), "k": (hidden, hidden), "v": (hidden, hidden),
                                 "o": (hidden, hidden), "up": (inner, hidden), "down": (hidden, inner)}.items():
            tensors[f"layers.{i}.{name}.weight"] = normal(out, inp, scale=inp ** -0.5)
            tensors[f"layers.{i}.{name}.bias"] = normal(out, scale=0.1)
        for name in ("ln1", "ln2"):
            tensors[f"layers.{i}.{name}.weight"] = 1 + normal(hidden, scale=0.1)
            tensors[f"layers.{i}.{name}.bias"] = normal(hidden, scale=0.1)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    return directory


def reference_greedy(directory: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens by a float64 numpy forward pass over the whole sequence at every step."""
    from safetensors.numpy import load_file
    from scipy.special import erf
    w = {k: v.astype(np.float64) for k, v in load_file(os.path.join(directory, "model.safetensors")).items()}
    heads, dim = SHAPE["num_attention_heads"], SHAPE["hidden_size"] // SHAPE["num_attention_heads"]

    def norm(x, name):
        x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
        return x * w[f"{name}.weight"] + w[f"{name}.bias"]

    def linear(x, name):
        return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]

    tokens = list(prompt)
    for _ in range(max_new_tokens):
        n = len(tokens)
        h = w["embed.weight"][tokens] + w["pos.weight"][:n]
        for i in range(SHAPE["num_hidden_layers"]):
            x = norm(h, f"layers.{i}.ln1")
            q, k, v = (linear(x, f"layers.{i}.{p}").reshape(n, heads, dim).transpose(1, 0, 2) for p in "qkv")
            scores = q @ k.transpose(0, 2, 1) / np.sqrt(dim) + np.triu(np.full((n, n), -np.inf), 1)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            h = h + linear((probs @ v).transpose(1, 0, 2).reshape(n, -1), f"layers.{i}.o")
            up = linear(norm(h, f"layers.{i}.ln2"), f"layers.{i}.up")
            h = h + linear(0.5 * up * (1 + erf(up / np.sqrt(2))), f"layers.{i}.down")
        logits = norm(h[-1], "final_norm") @ w["lm_head.weight"].T
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt):]
