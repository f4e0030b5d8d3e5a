"""paged.models.linear: the one linear layer (float64 numpy as the reference), its matmul backends, and the
partition specs every family's weights carry."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from paged.models import model_config_from_hf
from paged.models.linear import Linear, native_cpu_matmul, silu_gated, xla_matmul
from paged.models.loader import partition_specs
from paged.models.registry import model_class
from paged.kernels import cpu as cpu_kernel


@pytest.mark.parametrize("backend", ["xla", "cpu"])
@pytest.mark.parametrize("use_bias", [False, True])
def test_linear_matches_float64(backend, use_bias):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(5, 3, 32)).astype(np.float32)
    layer = Linear(64, jnp.float32, use_bias, "column", backend)
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype),
                          nn.unbox(layer.init(jax.random.key(0), jnp.asarray(x))["params"]))
    got = np.asarray(layer.apply({"params": params}, jnp.asarray(x)), np.float64)
    want = x.astype(np.float64) @ np.asarray(params["kernel"], np.float64)
    if use_bias:
        want = want + np.asarray(params["bias"], np.float64)
    assert got.shape == (5, 3, 64)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-5)


@pytest.mark.parametrize("features, packed", [(128, True), (100, False)])
def test_bfloat16_linear_on_amx_holds_its_kernel_packed(features, packed):
    """The "cpu" backend's bfloat16 kernel on AMX is declared in the packed layout, initialised as the [in, out]
    kernel (lecun normal: std 1/sqrt(in)) and multiplied as that kernel; widths off the 64-column panels keep
    [in, out]. Checked against float64 of the unpacked kernel."""
    if not cpu_kernel.matmul_on_amx():
        pytest.skip("no AMX on this CPU: bfloat16 kernels stay [in, out]")
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(3, 5, 96)), jnp.bfloat16)
    layer = Linear(features, jnp.bfloat16, backend="cpu", out_dtype=jnp.float32)
    params = nn.unbox(layer.init(jax.random.key(0), x)["params"])
    if not packed:
        assert params["kernel"].shape == (96, features)
        return
    assert params["kernel"].shape == cpu_kernel.amx_packed_shape(96, features)
    kernel = np.asarray(cpu_kernel.unpack_from_amx(params["kernel"], 96), np.float64)
    assert 0.7 < kernel.std() * np.sqrt(96) < 1.3
    got = np.asarray(layer.apply({"params": params}, x), np.float64)
    np.testing.assert_allclose(got, np.asarray(x, np.float64) @ kernel, atol=2e-4, rtol=2e-5)


class _SiluGated(nn.Module):
    use_bias: bool = False

    @nn.compact
    def __call__(self, x):
        gate = Linear(128, jnp.bfloat16, self.use_bias, backend="cpu", name="gate_proj")
        up = Linear(128, jnp.bfloat16, self.use_bias, backend="cpu", name="up_proj")
        return silu_gated(x, gate, up)


@pytest.mark.parametrize("use_bias", [False, True], ids=["fused", "bias-unfused"])
def test_silu_gated_on_amx_matches_float64(use_bias):
    """silu(gate(x)) * up(x) with both kernels packed: one native call without biases, the two layers and
    XLA's silu with them. Parameters are the two layers' own (gate_proj/kernel, up_proj/kernel), so checkpoints
    load unchanged; checked against float64 of the unpacked kernels to bfloat16's rounding of the result
    (and, unfused, of each layer's output)."""
    if not cpu_kernel.matmul_on_amx():
        pytest.skip("no AMX on this CPU: bfloat16 kernels stay [in, out]")
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(2, 9, 96)), jnp.bfloat16)
    module = _SiluGated(use_bias)
    params = nn.unbox(module.init(jax.random.key(1), x)["params"])
    assert set(params) == {"gate_proj", "up_proj"}
    assert set(params["gate_proj"]) == ({"kernel", "bias"} if use_bias else {"kernel"})
    if use_bias:
        params["gate_proj"]["bias"] = jnp.full(128, 0.5, jnp.bfloat16)
    got = np.asarray(module.apply({"params": params}, x), np.float64)
    program = str(jax.make_jaxpr(lambda p: module.apply({"params": p}, x))(params))
    assert ("gated_matmul_packed_cpu" in program) == (not use_bias)
    x64 = np.asarray(x, np.float64)
    gate = x64 @ np.asarray(cpu_kernel.unpack_from_amx(params["gate_proj"]["kernel"], 96), np.float64)
    up = x64 @ np.asarray(cpu_kernel.unpack_from_amx(params["up_proj"]["kernel"], 96), np.float64)
    if use_bias:
        gate = gate + 0.5
    np.testing.assert_allclose(got, gate / (1 + np.exp(-gate)) * up, atol=2e-3, rtol=2e-2 if use_bias else 2 ** -8)


def test_loader_packs_bfloat16_kernels_for_amx(tiny_model_dir):
    """A checkpoint loaded in bfloat16 for the "cpu" backend holds every projection the checkpoint stores as
    [out, in] packed, and unpacking gives back the stored weights exactly."""
    if not cpu_kernel.matmul_on_amx():
        pytest.skip("no AMX on this CPU: bfloat16 kernels stay [in, out]")
    import os

    from safetensors.numpy import load_file

    from paged.models import load_model
    *_, params, _ = load_model(tiny_model_dir, dtype="bfloat16", linear_backend="cpu", show_progress=False)
    stored = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    q = params["layers"]["self_attn"]["q_proj"]["kernel"]
    hidden = stored["model.layers.1.self_attn.q_proj.weight"].shape[1]
    assert q.shape[1:] == cpu_kernel.amx_packed_shape(hidden, q.shape[1] * 64)
    for layer in range(q.shape[0]):
        for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
            module, proj = name.split(".")
            packed = params["layers"][module][proj]["kernel"][layer]
            want = np.asarray(stored[f"model.layers.{layer}.{name}.weight"].T, jnp.bfloat16)
            np.testing.assert_array_equal(np.asarray(cpu_kernel.unpack_from_amx(packed, want.shape[0])), want)


def test_linear_out_dtype_keeps_float32_logits_from_bfloat16_weights():
    layer = Linear(64, jnp.bfloat16, out_dtype=jnp.float32)
    x = jnp.ones((2, 16), jnp.bfloat16)
    params = nn.unbox(layer.init(jax.random.key(0), x)["params"])
    assert params["kernel"].dtype == jnp.bfloat16
    assert layer.apply({"params": params}, x).dtype == jnp.float32


def test_native_matmul_skips_rows_past_live_rows():
    """Products given a live-row count compute that many rows and give zeros after them; others are whole."""
    if not cpu_kernel.matmul_is_vectorized():
        pytest.skip("no AVX-512: the model keeps XLA's dot, which skips nothing")
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.normal(size=(64, 128)), jnp.float32)

    @jax.jit
    def step(a, b, n):
        return native_cpu_matmul(a, w, n), native_cpu_matmul(b, w)

    a = jnp.asarray(rng.normal(size=(48, 64)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(16, 64)), jnp.float32)
    got_a, got_b = step(a, b, jnp.int32(30))
    want_a, want_b = np.asarray(a) @ np.asarray(w), np.asarray(b) @ np.asarray(w)
    np.testing.assert_allclose(np.asarray(got_a[:30]), want_a[:30], atol=2e-4, rtol=2e-5)
    assert not np.any(np.asarray(got_a[30:]))
    np.testing.assert_allclose(np.asarray(got_b), want_b, atol=2e-4, rtol=2e-5)


@pytest.mark.parametrize("lhs_shape, rhs_shape, dtype, native", [
    ((48, 512), (512, 128), np.float32, True),
    ((2, 3, 64), (64, 64), np.float32, True),     # leading dims flattened into rows
    ((192, 64), (64, 64), np.float32, True),      # the most rows it takes
    ((193, 64), (64, 64), np.float32, False),     # a prompt-sized step: XLA's dot
    ((8, 64), (64, 100), np.float32, False),      # N not a multiple of 64
    ((8, 64), (64, 64), jnp.bfloat16, True),      # AMX, or AVX-512 BF16
    ((256, 64), (64, 64), jnp.bfloat16, True),    # the most bf16 rows AVX-512 BF16 takes
    ((257, 64), (64, 64), jnp.bfloat16, "amx"),   # on AMX tiles every row count
    ((8, 63), (63, 64), jnp.bfloat16, False),     # an odd K: bf16 pairs cannot cover it
    ((8, 64), (64, 64), np.float16, False),
])
def test_native_matmul_routes_and_matches_xla(monkeypatch, lhs_shape, rhs_shape, dtype, native):
    calls = []
    real = cpu_kernel.matmul_cpu
    monkeypatch.setattr(cpu_kernel, "matmul_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.normal(size=lhs_shape), dtype)
    rhs = jnp.asarray(rng.normal(size=rhs_shape), dtype)
    got = native_cpu_matmul(lhs, rhs)
    want = xla_matmul(lhs, rhs)
    if native == "amx":
        native = cpu_kernel.matmul_on_amx()
    assert bool(calls) == (native and cpu_kernel.matmul_is_vectorized(dtype))
    assert got.shape == want.shape and got.dtype == want.dtype
    # Both sum in float32 and round once: in bfloat16 the two may differ by one unit in the last place (2^-8).
    tol = 2e-3 if dtype == np.float32 else 8e-3
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), atol=tol, rtol=tol)


@pytest.mark.parametrize("bits, group_size, rows, dtype, native", [
    (8, -1, 8, jnp.float32, True),      # per-channel int8 at decode size: the native quantized matmul
    (8, -1, 192, jnp.bfloat16, True),   # bf16 activations go in as they are (codes as bfloat16 pairs)
    (8, -1, 512, jnp.float32, True),    # prompt-sized too (dequantizing every step costs more)
    (8, -1, 2049, jnp.float32, False),  # past cpu.MATMUL_MAX_ROWS["int8"]: dequantize, then XLA's dot
    (8, 32, 8, jnp.float32, True),      # grouped scales
    (4, 32, 8, jnp.float32, True),      # packed int4
    (4, -1, 8, jnp.bfloat16, True),
    (4, -1, 1024, jnp.bfloat16, True),
    (4, -1, 1025, jnp.bfloat16, False),  # past cpu.MATMUL_MAX_ROWS["int4_bfloat16"]: dequantize, then XLA's dot
    (4, -1, 1025, jnp.float32, True),    # float32 x keeps the native call up to 2,048 rows
    (4, 24, 8, jnp.float32, False),     # 24-row groups do not fit the 128-row blocks: dequantized
])
def test_quantized_linear_matches_float64_of_the_decoded_weights(monkeypatch, bits, group_size, rows, dtype,
                                                                   native):
    """Against float64 numpy of W = q * scale - zero_offset, decoded here from the layout's description. (On a
    CPU with AMX, per-channel int8 layers of bfloat16 models take the AMX path, tested in test_low_precision_dot;
    here, as on a CPU without it.)"""
    from paged.models.quantization import WeightQuant
    monkeypatch.setattr(cpu_kernel, "int8_weights_on_amx", lambda: False)
    calls = []
    real = cpu_kernel.quant_matmul_cpu
    monkeypatch.setattr(cpu_kernel, "quant_matmul_cpu", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    rng = np.random.default_rng(bits + rows)
    quant = WeightQuant(bits=bits, group_size=group_size)
    in_features = 72 if group_size == 24 else 64
    layer = Linear(128, dtype, backend="cpu", quant=quant)
    x = jnp.asarray(rng.normal(size=(rows, in_features)), dtype)
    shapes = nn.unbox(layer.init(jax.random.key(0), x)["params"])
    q = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), size=(in_features, 128))
    groups = quant.num_groups(in_features)
    scales = rng.uniform(0.01, 0.1, size=(groups, 128))
    offsets = rng.uniform(-0.2, 0.2, size=(groups, 128))
    if bits == 8:
        qweight = q.astype(np.int8)
    else:
        nibbles = (q + 8).astype(np.uint8)
        qweight = nibbles[0::2] | (nibbles[1::2] << 4)
    params = {"qweight": jnp.asarray(qweight), "scales": jnp.asarray(scales, dtype),
              "zero_offsets": jnp.asarray(offsets, dtype)}
    assert {k: v.shape for k, v in params.items()} == {k: v.shape for k, v in shapes.items()}
    got = np.asarray(layer.apply({"params": params}, x), np.float64)
    g = np.arange(in_features) // quant.group_rows(in_features)
    w = q * np.asarray(params["scales"], np.float64)[g] - np.asarray(params["zero_offsets"], np.float64)[g]
    want = np.asarray(x, np.float64) @ w
    assert bool(calls) == (native and cpu_kernel.matmul_is_vectorized("int8"))
    if calls and dtype == jnp.bfloat16:
        assert calls[0] == (jnp.bfloat16 if cpu_kernel.quant_matmul_takes_bfloat16(in_features, groups) else jnp.float32)
    tol = 1e-4 if dtype == jnp.float32 else 3e-2  # bf16 rounds x and the result: 2^-8 relative
    np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max(), rtol=tol)


_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128, hidden_size=64,
              intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _int4_params(rng, in_features, out_features, quant, dtype):
    """GPTQ-layout int4 parameters (codes [in / 2, out] uint8, row 2i in the low nibble) and the float64 kernel
    they decode to: (u - 8) * scale - offset, per group of rows."""
    u = rng.integers(0, 16, size=(in_features, out_features))
    groups = quant.num_groups(in_features)
    scales = jnp.asarray(rng.uniform(0.01, 0.1, size=(groups, out_features)), dtype)
    offsets = jnp.asarray(rng.uniform(-0.2, 0.2, size=(groups, out_features)), dtype)
    g = np.arange(in_features) // quant.group_rows(in_features)
    w = (u - 8) * np.asarray(scales, np.float64)[g] - np.asarray(offsets, np.float64)[g]
    qweight = (u[0::2] | (u[1::2] << 4)).astype(np.uint8)
    return {"qweight": qweight, "scales": scales, "zero_offsets": offsets}, w


@pytest.mark.parametrize("group_size, use_bias", [(-1, True), (64, False), (128, True)])
def test_int4_layers_of_bfloat16_models_on_amx(monkeypatch, group_size, use_bias):
    """A weight-only int4 layer of a bfloat16 model, in groups of a multiple of 64 rows (or one per column), holds
    its codes packed for the int8 tiles (the loader's `to_declared_layout` packs GPTQ's layout) and runs there:
    float64 of x @ ((u - 8) * scale - offset) + bias to one bfloat16 rounding, at decode and prompt sizes. Other
    group sizes and float32 models keep the other path."""
    from paged.models.linear import packs_int4_for_amx, to_declared_layout
    from paged.models.quantization import WeightQuant
    if not cpu_kernel.int4_on_amx():
        pytest.skip("no AMX-INT8 tiles here")
    quant = WeightQuant(bits=4, group_size=group_size)
    assert packs_int4_for_amx("cpu", quant, jnp.bfloat16, 128)
    assert not packs_int4_for_amx("cpu", WeightQuant(bits=4, group_size=32), jnp.bfloat16, 128)
    assert not packs_int4_for_amx("cpu", quant, jnp.float32, 128)
    assert not packs_int4_for_amx("xla", quant, jnp.bfloat16, 128)
    calls = []
    real = cpu_kernel.int4_matmul_packed_cpu
    monkeypatch.setattr(cpu_kernel, "int4_matmul_packed_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = np.random.default_rng(group_size + 7)
    layer = Linear(128, jnp.bfloat16, use_bias, backend="cpu", quant=quant)
    declared = nn.unbox(layer.init(jax.random.key(0), jnp.ones((2, 256), jnp.bfloat16))["params"])
    assert declared["qweight"].shape == cpu_kernel.amx_int4_packed_shape(256, 128)
    calls.clear()
    params, w = _int4_params(rng, 256, 128, quant, jnp.bfloat16)
    params["qweight"] = jnp.asarray(to_declared_layout(params["qweight"], declared["qweight"].shape))
    bias = np.zeros(128)
    if use_bias:
        params["bias"] = jnp.asarray(rng.normal(size=128), jnp.bfloat16)
        bias = np.asarray(params["bias"], np.float64)
    for rows in (3, 70):
        x = jnp.asarray(rng.normal(size=(rows, 256)), jnp.bfloat16)
        got = np.asarray(jax.jit(lambda p, x: layer.apply({"params": p}, x))(params, x), np.float64)
        want = np.asarray(x, np.float64) @ w + bias
        np.testing.assert_allclose(got, want, rtol=8e-3, atol=8e-3 * np.abs(want).max())
    assert len(calls) == 2


def test_an_int4_gated_mlp_on_amx_is_one_call(monkeypatch):
    """silu_gated over two int4 layers held for the int8 tiles makes one native call, matching the two layers'
    own outputs through XLA's silu to their bfloat16 rounding."""
    from paged.models.quantization import WeightQuant
    if not cpu_kernel.int4_on_amx():
        pytest.skip("no AMX-INT8 tiles here")
    quant = WeightQuant(bits=4, group_size=64)

    class Gated(nn.Module):
        fused: bool

        @nn.compact
        def __call__(self, x):
            gate, up = (Linear(128, jnp.bfloat16, backend="cpu", quant=quant, name=n) for n in ("gate", "up"))
            return silu_gated(x, gate, up) if self.fused else jax.nn.silu(gate(x)) * up(x)

    calls = []
    real = cpu_kernel.int4_gated_matmul_packed_cpu
    monkeypatch.setattr(cpu_kernel, "int4_gated_matmul_packed_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = np.random.default_rng(5)
    params = {}
    for name in ("gate", "up"):
        p, _ = _int4_params(rng, 192, 128, quant, jnp.bfloat16)
        params[name] = {**p, "qweight": jnp.asarray(cpu_kernel.pack_int4_for_amx(p["qweight"]))}
    x = jnp.asarray(rng.normal(size=(2, 5, 192)), jnp.bfloat16)
    fused = np.asarray(Gated(True).apply({"params": params}, x), np.float64)
    assert len(calls) == 1 and fused.shape == (2, 5, 128)
    separate = np.asarray(Gated(False).apply({"params": params}, x), np.float64)
    np.testing.assert_allclose(fused, separate, rtol=2e-2, atol=2e-2 * np.abs(separate).max())


def test_llama_weights_carry_megatron_partition_specs():
    """q/k/v and gate/up split their outputs over the tensor axis, o and down their inputs; the embedding and
    LM head split the vocabulary; norms are replicated; the stacked layer axis is never split."""
    config = model_config_from_hf(dict(_LLAMA, tie_word_embeddings=False))
    specs = partition_specs(model_class(config.architecture)(config, jnp.float32))
    attn, mlp = ("layers", "self_attn"), ("layers", "mlp")
    for name in ("q_proj", "k_proj", "v_proj"):
        assert specs[(*attn, name, "kernel")] == P(None, None, "tensor")
    assert specs[(*attn, "o_proj", "kernel")] == P(None, "tensor", None)
    assert specs[(*mlp, "gate_proj", "kernel")] == specs[(*mlp, "up_proj", "kernel")] == P(None, None, "tensor")
    assert specs[(*mlp, "down_proj", "kernel")] == P(None, "tensor", None)
    assert specs[("embed_tokens", "embedding")] == P("tensor", None)
    assert specs[("lm_head", "kernel")] == P(None, "tensor")
    assert specs[("layers", "input_layernorm", "scale")] == P(None)
    assert specs[("norm", "scale")] == P()


def test_moe_experts_are_grouped_and_split():
    config = model_config_from_hf(dict(_LLAMA, architectures=["MixtralForCausalLM"], model_type="mixtral",
                                       num_local_experts=4, num_experts_per_tok=2))
    specs = partition_specs(model_class(config.architecture)(config, jnp.float32))
    assert specs[("layers", "mlp", "experts_gate_proj", "kernel")] == P(None, None, None, "tensor")
    assert specs[("layers", "mlp", "experts_down_proj", "kernel")] == P(None, None, "tensor", None)
    assert specs[("layers", "mlp", "gate", "kernel")] == P(None, None, None)


@pytest.mark.parametrize("dtype, hidden", [(jnp.bfloat16, 64), (jnp.bfloat16, 48), (np.float32, 64)])
def test_tied_lm_head_routes_and_matches_xla(monkeypatch, dtype, hidden):
    """`Embedding.attend` with the "cpu" backend: bfloat16 tables with a hidden size that is a multiple of 32
    run the native transposed matmul on AMX (rows past live_rows zeros); others keep XLA's einsum."""
    from paged.models.linear import Embedding
    calls = []
    real = cpu_kernel.matmul_transposed_cpu
    monkeypatch.setattr(cpu_kernel, "matmul_transposed_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    embed = Embedding(300, hidden, dtype, backend="cpu")
    params = embed.init(jax.random.PRNGKey(0), jnp.zeros((2,), jnp.int32))
    h = jnp.asarray(np.random.default_rng(0).normal(size=(6, hidden)), dtype)
    got = np.asarray(embed.apply(params, h, jnp.int32(4), method="attend"), np.float64)
    want = np.asarray(Embedding(300, hidden, dtype).apply(params, h, method="attend"), np.float64)
    native = dtype == jnp.bfloat16 and hidden % 32 == 0 and cpu_kernel.transposed_matmul_native()
    assert bool(calls) == native
    rows = 4 if native else 6
    np.testing.assert_allclose(got[:rows], want[:rows], atol=1e-4, rtol=1e-4)
    assert not native or not np.any(got[4:])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32])
def test_tied_lm_head_of_one_row_matches_float64(dtype):
    """One sequence's decode: XLA's path takes a one-row bfloat16 product as two rows (its one-row dot widens
    the whole table first); the logits are the row's own, as float64 computes them from the same values."""
    from paged.models.linear import Embedding
    embed = Embedding(1000, 64, dtype)
    params = embed.init(jax.random.PRNGKey(0), jnp.zeros((2,), jnp.int32))
    h = jnp.asarray(np.random.default_rng(1).normal(size=(1, 64)), dtype)
    got = np.asarray(embed.apply(params, h, method="attend"))
    table = np.asarray(nn.unbox(params["params"])["embedding"], np.float64)
    want = np.asarray(h, np.float64) @ table.T
    assert got.shape == (1, 1000) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("parallel", ["column", "row"])
def test_lora_slots_add_each_tokens_adapter(parallel):
    """A Linear with LoRA slots adds x @ a[slot] @ b[slot] to each token's output (slot -1: the base alone),
    as float64 computes it; outside `lora_token_slots` it is the base layer."""
    from paged.models.linear import Linear, lora_token_slots
    layer = Linear(24, jnp.float32, parallel=parallel, lora_slots=3, lora_rank=4)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 16)).astype(np.float32)
    params = nn.unbox(layer.init(jax.random.key(0), jnp.asarray(x))["params"])
    params["lora_a"] = jnp.asarray(rng.normal(size=(16, 3, 4)), jnp.float32)
    params["lora_b"] = jnp.asarray(rng.normal(size=(3, 4, 24)), jnp.float32)
    slots = np.array([-1, 0, 2, 1, 2], np.int32)
    with lora_token_slots(jnp.asarray(slots)):
        got = np.asarray(layer.apply({"params": params}, jnp.asarray(x)), np.float64)
    base = x.astype(np.float64) @ np.asarray(params["kernel"], np.float64)
    a, b = np.asarray(params["lora_a"], np.float64), np.asarray(params["lora_b"], np.float64)
    want = base + np.stack([np.zeros(24) if s < 0 else x[t] @ a[:, s] @ b[s] for t, s in enumerate(slots)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(layer.apply({"params": params}, jnp.asarray(x))), base, rtol=1e-5,
                               atol=1e-5)
