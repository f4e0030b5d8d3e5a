"""Building blocks shared by the model families: RMSNorm, rotary embedding, gated MLP, GQA attention.

Every projection is a `paged.models.linear.Linear`; `live_rows` (the step's real token count) passes through to it.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from paged.models.config import ModelConfig
from paged.models.linear import Linear, silu_gated
from paged.kernels import cpu

_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    if name not in _ACTIVATIONS:
        raise NotImplementedError(f"hidden_act {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as transformers does.

    Llama casts the normalised value back before scaling by `weight`; Gemma (plus_one) scales by
    (1 + weight) in float32 and casts last. The order matters for bf16 parity.
    """

    eps: float
    dtype: Any
    plus_one: bool = False
    backend: str = "xla"  # "cpu": with a residual, bfloat16, the add and the norm are one native call

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array | None = None):
        """The norm of x; with `residual`, (x + residual, the norm of that): the residual add that comes before
        every norm of a decoder layer. On the native path (bfloat16) one pass over the rows
        (`paged.kernels.cpu.add_rms_norm_cpu`), whose norm reads the float32 sum before its rounding, as XLA's
        fusion of the jnp path here does (and vLLM's fused_add_rms_norm)."""
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), self.dtype)
        if residual is None:
            return self._normalize(x, scale)
        if (self.backend == "cpu" and not self.plus_one and
                all(a.dtype == jnp.bfloat16 for a in (x, residual, scale)) and cpu.available()[0]):
            rows = math.prod(x.shape[:-1])
            total, normed = cpu.add_rms_norm_cpu(x.reshape(rows, x.shape[-1]), residual.reshape(rows, x.shape[-1]),
                                                 scale, self.eps)
            return total.reshape(x.shape), normed.reshape(x.shape)
        x = x + residual
        return x, self._normalize(x, scale)

    def _normalize(self, x: jax.Array, scale: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        normed = x32 * jax.lax.rsqrt(variance + self.eps)
        if self.plus_one:
            return (normed * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)
        return scale * normed.astype(self.dtype)


def _rotary_angles(positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    return positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]


def _scaled_cos_sin(angles: jax.Array, scaling: float) -> tuple[jax.Array, jax.Array]:
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scaling != 1.0:  # YaRN's attention factor, applied to both in float32 as transformers does
        cos, sin = cos * jnp.float32(scaling), sin * jnp.float32(scaling)
    return cos, sin


def rotary_table(num_positions: int, inv_freq: np.ndarray, scaling: float = 1.0) -> jax.Array:
    """float32 [num_positions, 2, rotary_dim // 2]: cos and sin of each position's angles (times `scaling`),
    computed as `rotary_cos_sin` computes them, for it to look up instead (vLLM's cos/sin cache)."""
    cos, sin = _scaled_cos_sin(_rotary_angles(jnp.arange(num_positions), inv_freq), scaling)
    return jnp.stack([cos, sin], axis=1)


def rotary_cos_sin(positions: jax.Array, inv_freq: np.ndarray, interleaved: bool = False,
                   table: jax.Array | None = None, scaling: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos, sin float32 [T, rotary_dim]: each frequency twice, as [f0..fn, f0..fn] for the rotate-half
    layout or [f0, f0, f1, f1, ...] for the interleaved one; both times `scaling` (the rope's
    attention_scaling; a table holds it already).

    With a `rotary_table` the rows are looked up: computed here, XLA fuses cos and sin into every layer's
    rotation of q and k and evaluates them once per element of each (~4% of a CPU decode step).
    """
    if table is None:
        cos, sin = _scaled_cos_sin(_rotary_angles(positions, inv_freq), scaling)
    else:
        rows = table[positions]
        cos, sin = rows[:, 0], rows[:, 1]
    if interleaved:
        return jnp.repeat(cos, 2, axis=-1), jnp.repeat(sin, 2, axis=-1)
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)


def rotary_cos_sin_by_length(positions: jax.Array, lengths: jax.Array, rope, rotary_dim: int,
                             interleaved: bool = False) -> tuple[jax.Array, jax.Array]:
    """cos, sin float32 [T, rotary_dim] for a rope whose frequencies follow the sequence's length
    (`rope.length_dependent`), per token: `lengths` int32 [T] is the length each token's frequencies follow
    (AttentionMetadata.rope_lengths). As transformers computes them in float32:
      dynamic NTK: base * ((factor * L / max_pos) - (factor - 1)) ** (d / (d - 2)), L at least max_pos;
      LongRoPE: the long factors past original_max_position_embeddings, the short ones up to it, and the
      attention factor on cos and sin.
    """
    exponents = jnp.arange(0, rotary_dim, 2, dtype=jnp.int32).astype(jnp.float32) / jnp.float32(rotary_dim)
    if rope.rope_type == "dynamic":
        length = jnp.maximum(lengths, rope.max_position_embeddings).astype(jnp.float32)
        ratio = jnp.float32(rope.factor) * length / jnp.float32(rope.max_position_embeddings) \
            - jnp.float32(rope.factor - 1)
        base = jnp.float32(rope.theta) * ratio ** jnp.float32(rotary_dim / (rotary_dim - 2))
        inv_freq = 1.0 / (base[:, None] ** exponents[None, :])
    elif rope.rope_type == "longrope":
        long = lengths > rope.original_max_position_embeddings
        inv_freq = jnp.where(long[:, None], jnp.asarray(rope.longrope_inv_freq(rotary_dim, long=True)),
                             jnp.asarray(rope.longrope_inv_freq(rotary_dim, long=False)))
    else:
        raise ValueError(f"rope_type {rope.rope_type!r} does not depend on the length")
    angles = positions.astype(jnp.float32)[:, None] * inv_freq
    cos, sin = _scaled_cos_sin(angles, rope.attention_scaling)
    if interleaved:
        return jnp.repeat(cos, 2, axis=-1), jnp.repeat(sin, 2, axis=-1)
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool = False) -> jax.Array:
    """x: [T, heads, head_dim]; cos/sin: [T, rotary_dim]. Rotates the first rotary_dim dims of each head (the
    rest pass through): halves (GPT-NeoX layout) or adjacent pairs (GPT-J / GLM layout)."""
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        pairs = x_rot.reshape(*x_rot.shape[:-1], rotary_dim // 2, 2)
        rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x_rot.shape)
    else:
        half = rotary_dim // 2
        rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    cos = cos[:, None, :].astype(x.dtype)
    sin = sin[:, None, :].astype(x.dtype)
    out = x_rot * cos + rotated * sin
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out


class Block(nn.Module):
    """What every block of a model family is built with: the config, the compute dtype, and the backend of
    its linear layers (paged.models.linear)."""

    config: ModelConfig
    dtype: Any
    linear_backend: str = "xla"


class GatedMLP(Block):
    """act(x @ gate) * (x @ up) @ down: gate and up column-parallel, down row-parallel."""

    intermediate_size: int | None = None  # default: the config's (MoE shared experts have their own)

    @nn.compact
    def __call__(self, x: jax.Array, live_rows: jax.Array | None = None) -> jax.Array:
        cfg = self.config
        inter = self.intermediate_size or cfg.intermediate_size
        linear = lambda n, name, parallel: Linear(n, self.dtype, cfg.mlp_bias, parallel, self.linear_backend,
                                                  quant=cfg.weight_quant, lora_slots=cfg.lora_slots,
                                                  lora_rank=cfg.lora_rank, name=name)
        gate, up = linear(inter, "gate_proj", "column"), linear(inter, "up_proj", "column")
        if activation(cfg.hidden_act) is jax.nn.silu:
            hidden = silu_gated(x, gate, up, live_rows)  # one native call where it can
        else:
            hidden = activation(cfg.hidden_act)(gate(x, live_rows)) * up(x, live_rows)
        return linear(cfg.hidden_size, "down_proj", "row")(hidden, live_rows)


class PagedSelfAttention(Block):
    """GQA self-attention whose keys and values live in the paged KV pool.

    `attention` is the backend (paged.models.attention); the pool is the whole stacked cache, `layer` selects ours.
    q/k/v are column-parallel (whole heads per shard), o row-parallel.
    """

    @nn.compact
    def __call__(self, x, cos, sin, k_cache, v_cache, layer, window, meta, attention, live_rows=None):
        cfg = self.config
        num_tokens = x.shape[0]
        linear = lambda n, name, bias, parallel: Linear(n, self.dtype, bias, parallel, self.linear_backend,
                                                        quant=cfg.weight_quant, lora_slots=cfg.lora_slots,
                                                        lora_rank=cfg.lora_rank, name=name)
        q = linear(cfg.q_size, "q_proj", cfg.attention_bias, "column")(x, live_rows)
        k = linear(cfg.kv_size, "k_proj", cfg.attention_bias, "column")(x, live_rows)
        v = linear(cfg.kv_size, "v_proj", cfg.attention_bias, "column")(x, live_rows)
        q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.norm_plus_one, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.norm_plus_one, name="k_norm")(k)
        q = apply_rotary(q, cos, sin, cfg.rotary_interleaved)
        k = apply_rotary(k, cos, sin, cfg.rotary_interleaved)
        scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        if cfg.kv_scales:  # an fp8 pool with the checkpoint's scales: it stores k / k_scale and v / v_scale
            scalar = lambda name: self.param(name, nn.with_partitioning(nn.initializers.ones, ()), (), jnp.float32)
            k_scale, v_scale = scalar("k_scale"), scalar("v_scale")
            k, v = (k / k_scale).astype(k.dtype), (v / v_scale).astype(v.dtype)
            # (q * k_scale) . (k / k_scale): the same scores, while `scale` stays the static float kernels take.
            q = (q * k_scale).astype(q.dtype)
        k_cache, v_cache = attention.write_kv(k_cache, v_cache, layer, k, v, meta)
        out = attention.attend(q, k, v, k_cache, v_cache, layer, meta, scale=scale,
                               sliding_window=window if cfg.layer_windows else None, soft_cap=cfg.attn_soft_cap)
        if cfg.kv_scales:  # softmax(...) @ (v / v_scale), times v_scale
            out = (out * v_scale).astype(out.dtype)
        out = linear(cfg.hidden_size, "o_proj", cfg.o_proj_bias, "row")(out.reshape(num_tokens, cfg.q_size),
                                                                        live_rows)
        return out, k_cache, v_cache


def unrolled_layers(layer_loop: str, platform: str) -> bool:
    """Whether a model loads its layers as a list for the unrolled loop (`run_layers`): `layer_loop`
    "unroll", or "auto" on CPU, where the scanned loop's weight copies cost more than compiling every layer."""
    return layer_loop == "unroll" or (layer_loop == "auto" and platform == "cpu")


def run_layers(one_layer: Callable, carry, layer_params, per_layer: tuple[jax.Array, ...]):
    """Applies `one_layer(carry, (params, *per_layer[i])) -> carry` for every decoder layer.

    `layer_params` is either one tree stacked over layers, which is scanned (one layer compiled: fastest
    start-up), or a list of per-layer trees, which is unrolled. XLA's CPU matmuls cannot read a scanned
    layer's weights in place: each step would copy every layer's slice of the stacked arrays first, which
    costs 10-30% of a decode step. `per_layer` holds arrays with a leading layer axis (e.g. layer ids).
    """
    if isinstance(layer_params, (list, tuple)):
        for index, params in enumerate(layer_params):
            carry = one_layer(carry, (params, *(x[index] for x in per_layer)))
        return carry
    carry, _ = jax.lax.scan(lambda c, xs: (one_layer(c, xs), None), carry, (layer_params, *per_layer))
    return carry
