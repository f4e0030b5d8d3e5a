"""Shared layers: the rotary cos/sin, computed per step or looked up in the precomputed table."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged.models import model_config_from_hf
from paged.models.layers import RMSNorm, apply_rotary, rotary_cos_sin, rotary_table
from paged.kernels import cpu as cpu_kernel
from paged.models.llama import LlamaForCausalLM

INV_FREQ = (1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)  # rotary_dim 16


def _float64_cos_sin(positions, inv_freq):
    # Angles are float32 products in the model (and in transformers); only cos/sin run in float64 here.
    angles = (positions.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)
    return np.cos(angles), np.sin(angles)


@pytest.mark.parametrize("use_table", [False, True])
def test_rotary_cos_sin_matches_float64(use_table):
    max_positions = 4096
    positions = np.concatenate([[0, 1, max_positions - 1],
                                np.random.default_rng(0).integers(0, max_positions, 61)]).astype(np.int32)
    table = rotary_table(max_positions, INV_FREQ) if use_table else None
    cos, sin = rotary_cos_sin(jnp.asarray(positions), INV_FREQ, table=table)
    want_cos, want_sin = _float64_cos_sin(positions, INV_FREQ)
    # float32 cos/sin of a float32 angle: a few ulp of values <= 1.
    np.testing.assert_allclose(np.asarray(cos), np.concatenate([want_cos, want_cos], 1), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin), np.concatenate([want_sin, want_sin], 1), rtol=0, atol=1e-6)


def test_rotary_interleaved_layout_repeats_each_frequency():
    positions = np.array([0, 5, 17, 300], np.int32)
    table = rotary_table(512, INV_FREQ)
    cos, sin = rotary_cos_sin(jnp.asarray(positions), INV_FREQ, interleaved=True, table=table)
    want_cos, want_sin = _float64_cos_sin(positions, INV_FREQ)
    np.testing.assert_allclose(np.asarray(cos), np.repeat(want_cos, 2, axis=1), atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin), np.repeat(want_sin, 2, axis=1), atol=1e-6)


def test_rotation_from_table_equals_computed():
    rng = np.random.default_rng(1)
    positions = jnp.asarray(rng.integers(0, 1024, 24), jnp.int32)
    x = jnp.asarray(rng.standard_normal((24, 3, 16)), jnp.float32)
    computed = apply_rotary(x, *rotary_cos_sin(positions, INV_FREQ))
    looked_up = apply_rotary(x, *rotary_cos_sin(positions, INV_FREQ, table=rotary_table(1024, INV_FREQ)))
    np.testing.assert_allclose(np.asarray(looked_up), np.asarray(computed), rtol=0, atol=1e-6)


def test_precomputed_tables_cover_both_rotary_bases():
    gemma3 = model_config_from_hf({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16, "rope_theta": 1e6,
        "rope_local_base_freq": 1e4, "sliding_window_pattern": 6})
    tables = LlamaForCausalLM(gemma3, jnp.float32).precomputed(300)["rotary"]
    assert set(tables) == {"global", "local"}
    assert tables["global"].shape == tables["local"].shape == (300, 2, 8)
    for name, rope in (("global", gemma3.rope), ("local", gemma3.local_rope)):
        want_cos, want_sin = _float64_cos_sin(np.arange(300), rope.inv_freq(16))
        np.testing.assert_allclose(np.asarray(tables[name][:, 0]), want_cos, atol=1e-6)
        np.testing.assert_allclose(np.asarray(tables[name][:, 1]), want_sin, atol=1e-6)


@pytest.mark.parametrize("dtype, plus_one, native", [(jnp.bfloat16, False, True), (jnp.bfloat16, True, False),
                                                     (jnp.float32, False, False)], ids=["bf16", "gemma", "f32"])
def test_rms_norm_with_a_residual_on_the_native_path(dtype, plus_one, native):
    """The add before a norm and the norm: one native call for a bfloat16 Llama-style norm on the "cpu" backend,
    the jnp path for Gemma's (1 + weight) scale and for float32. Either way the sum is bit for bit the jnp
    add's, and the norm within two bfloat16 roundings (2^-7) of float64 of the norm of the exact sum, as the
    "xla" backend's is; without a residual both backends are the same jnp code."""
    if not cpu_kernel.available()[0]:
        pytest.skip("the native CPU kernels did not build")
    rng = np.random.default_rng(4)
    h, delta = (jnp.asarray(rng.normal(size=(3, 5, 96)) * sd, dtype) for sd in (3.0, 1.0))
    scale = jnp.asarray(rng.normal(size=96), dtype)
    on_cpu, on_xla = RMSNorm(1e-6, dtype, plus_one, "cpu"), RMSNorm(1e-6, dtype, plus_one, "xla")
    params = {"params": {"scale": scale}}
    program = str(jax.make_jaxpr(lambda: on_cpu.apply(params, h, delta))())
    assert ("add_rms_norm_cpu" in program) == native
    s = np.asarray(h, np.float64) + np.asarray(delta, np.float64)
    weight = np.asarray(scale, np.float64) + (1.0 if plus_one else 0.0)
    want = weight * s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + 1e-6)
    for module in (on_cpu, on_xla):
        total, normed = jax.jit(lambda h, d: module.apply(params, h, d))(h, delta)
        assert total.shape == normed.shape == h.shape and normed.dtype == dtype
        np.testing.assert_array_equal(np.asarray(total), np.asarray(h + delta))
        np.testing.assert_allclose(np.asarray(normed, np.float64), want, rtol=2 ** -7, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(on_cpu.apply(params, h)), np.asarray(on_xla.apply(params, h)))
