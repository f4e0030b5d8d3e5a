"""W8A8 through the platform's own int8 / fp8 dot (models/low_precision_dot.py): its values against float64 of
the same codes, and the lowered module for GPUs and TPUs showing the low-precision dot."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged.models import low_precision_dot
from paged.models.linear import Linear
from paged.models.quantization import WeightQuant, activation_codes, quantize_activations

INT8_DOT = re.compile(r"dot_general.*\(tensor<[0-9x]+xi8>, tensor<[0-9x]+xi8>\) -> tensor<[0-9x]+xi32>")
FP8_DOT = re.compile(r"dot_general.*\(tensor<[0-9x]+xf8E4M3FN>, tensor<[0-9x]+xf8E4M3FN>\) -> tensor<[0-9x]+xf32>")


def _w8a8(kind: str, in_features: int, out_features: int, seed: int, zero_points: bool = False,
          per_tensor: bool = False):
    """A W8A8 scheme and its layer parameters: int8 codes with a scale per column (and zero offsets), or
    e4m3 codes with a scale per column or one for the tensor."""
    rng = np.random.default_rng(seed)
    if kind == "int8":
        quant = WeightQuant(bits=8, group_size=-1, method="compressed-tensors", activations="int8")
        offsets = rng.uniform(-0.05, 0.05, (1, out_features)) if zero_points else np.zeros((1, out_features))
        params = {"qweight": jnp.asarray(rng.integers(-128, 128, (in_features, out_features)), jnp.int8),
                  "scales": jnp.asarray(rng.uniform(0.001, 0.01, (1, out_features)), jnp.float32),
                  "zero_offsets": jnp.asarray(offsets, jnp.float32)}
    else:
        block_out = out_features if per_tensor else 1
        quant = WeightQuant(bits=8, group_size=-1, method="compressed-tensors", kind="float8", block_out=block_out,
                            activations="fp8")
        codes = jnp.asarray(rng.normal(0, 40, (in_features, out_features)), jnp.float32).astype(jnp.float8_e4m3fn)
        params = {"qweight": codes,
                  "scales": jnp.asarray(rng.uniform(0.001, 0.01, (1, out_features // block_out)), jnp.float32)}
    return quant, params


def _float64_of_codes(x, params, quant) -> np.ndarray:
    """(x's codes * its row scales) @ (weight codes * column scales - offsets), in float64."""
    codes, row_scale = activation_codes(x, quant.activations)
    xd = np.asarray(codes.astype(jnp.float32), np.float64) * np.asarray(row_scale, np.float64)
    w = np.asarray(params["qweight"].astype(jnp.float32), np.float64)
    scales = np.asarray(params["scales"], np.float64)[0]
    w = w * np.repeat(scales, w.shape[1] // scales.shape[0])
    if "zero_offsets" in params:
        w = w - np.asarray(params["zero_offsets"], np.float64)[0]
    return xd @ w


@pytest.mark.parametrize("kind, zero_points, per_tensor", [("int8", False, False), ("int8", True, False),
                                                           ("fp8", False, False), ("fp8", False, True)],
                         ids=["int8", "int8-zero-points", "fp8-channel", "fp8-tensor"])
def test_w8a8_dot_matches_float64_of_the_same_codes(kind, zero_points, per_tensor):
    """Rows of very different sizes (one of zeros: its scale is eps, its codes 0); the int32 / float32 sums
    of codes are exact here, so only the final scaling rounds."""
    quant, params = _w8a8(kind, 96, 128, seed=1, zero_points=zero_points, per_tensor=per_tensor)
    assert low_precision_dot.takes(quant, params)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(5, 96)) * np.array([[1.0], [100.0], [0.0], [1e-3], [7.0]])
    x = jnp.asarray(x, jnp.float32)
    got = np.asarray(jax.jit(lambda x, p: low_precision_dot.w8a8_dot(x, p, quant))(x, params), np.float64)
    want = _float64_of_codes(x, params, quant)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not np.any(got[2])  # the zero row
    # The float path (dequantize both, float matmul) computes the same W8A8 values, rounded differently.
    from paged.models.linear import quantized_matmul
    from paged.models.quantization import dequantize_float8
    xq = quantize_activations(x, kind)
    if kind == "int8":
        floats = quantized_matmul("xla", xq, params, 8, None, jnp.float32)
    else:
        floats = xq @ dequantize_float8(params["qweight"], params["scales"], jnp.float32)
    np.testing.assert_allclose(got, np.asarray(floats, np.float64), rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("zero_points, use_bias", [(False, False), (True, False), (True, True)])
def test_the_cpus_int8_kernel_computes_w8a8_as_float64_does(monkeypatch, zero_points, use_bias):
    """With the "cpu" linear backend and AVX-512 VNNI (a CPU without AMX-INT8; on one with it, as if it had
    none), a W8A8 int8 Linear of prompt-sized steps routes to the native call (x quantized in it, then the
    integer matmul), and its output is float64's product of the same codes."""
    from paged.kernels import cpu
    if not cpu.int8_matmul_is_vectorized():
        pytest.skip("no AVX-512 VNNI here: W8A8 keeps the float path on this CPU")
    monkeypatch.setattr(cpu, "w8a8_on_amx", lambda: False)
    calls = []
    real = cpu.w8a8_matmul_cpu
    monkeypatch.setattr(cpu, "w8a8_matmul_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    quant, params = _w8a8("int8", 96, 128, seed=4, zero_points=zero_points)
    rows = cpu.INT8_MATMUL_MIN_ROWS
    assert low_precision_dot.route(quant, params, "cpu", rows) == "native"
    assert low_precision_dot.route(quant, params, "cpu", rows - 1) is None  # decode-sized: the weight-only path
    assert low_precision_dot.route(quant, params, "xla", rows) is None  # the CPU has no int8 dot of its own
    layer = Linear(128, jnp.float32, backend="cpu", quant=quant, use_bias=use_bias)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(2, rows // 2 + 3, 96)), jnp.float32)
    if use_bias:  # added in the call
        params = {**params, "bias": jnp.asarray(np.random.default_rng(6).uniform(-1, 1, 128), jnp.float32)}
    got = np.asarray(layer.apply({"params": params}, x), np.float64)
    assert calls
    want = _float64_of_codes(x, params, quant) + (np.asarray(params["bias"], np.float64) if use_bias else 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("zero_points", [False, True])
def test_w8a8_layers_on_amx_int8_compute_float64_of_the_same_codes(monkeypatch, dtype, zero_points):
    """On a CPU with AMX-INT8 the "cpu" backend holds a W8A8 layer's codes packed for the tiles and runs every
    step size through one call that quantizes x itself: decode-sized and prompt-sized steps, a zero row (scale
    eps, codes 0), zero points and a bias, padding rows past live_rows zeros. The codes are activation_codes'
    (a code off by one would move a value by a whole weight), so float32 results match float64 of them to
    rounding; bfloat16 ones to one rounding."""
    from paged.kernels import cpu
    from paged.models.linear import packs_w8a8_for_amx
    if not cpu.w8a8_on_amx():
        pytest.skip("no AMX-INT8 tiles here")
    calls = []
    real = cpu.w8a8_matmul_packed_cpu
    monkeypatch.setattr(cpu, "w8a8_matmul_packed_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    quant, params = _w8a8("int8", 96, 128, seed=6, zero_points=zero_points)
    assert packs_w8a8_for_amx("cpu", quant, 128) and not packs_w8a8_for_amx("xla", quant, 128)
    assert not packs_w8a8_for_amx("cpu", quant, 96)  # not whole panels: the other paths
    layer = Linear(128, dtype, use_bias=True, backend="cpu", quant=quant)
    declared = nn.unbox(layer.init(jax.random.key(0), jnp.ones((2, 96), dtype))["params"])
    assert declared["qweight"].shape == cpu.amx_packed_shape(96, 128, jnp.int8) == (2, 2, 4096)
    rng = np.random.default_rng(7)
    bias = rng.normal(size=128)
    held = {**{k: v.astype(declared[k].dtype) for k, v in params.items()},
            "qweight": cpu.pack_for_amx(params["qweight"]), "bias": jnp.asarray(bias, dtype)}
    for rows in (3, 133):  # one A tile; 32-row blocks and a short last one
        x = rng.normal(size=(rows, 96)) * rng.choice([1.0, 30.0, 1e-3], size=(rows, 1))
        x[1] = 0.0
        x = jnp.asarray(x, dtype)
        got = np.asarray(jax.jit(lambda p, x: layer.apply({"params": p}, x))(held, x), np.float64)
        as_held = {**params, **{k: held[k].astype(jnp.float32) for k in ("scales", "zero_offsets")}}
        want = _float64_of_codes(x, as_held, quant) + np.asarray(held["bias"], np.float64)
        tolerance = 1e-5 if dtype == jnp.float32 else 8e-3
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * np.abs(want).max())
        live = jax.jit(lambda p, x: layer.apply({"params": p}, x, jnp.int32(rows - 2)))(held, x)
        np.testing.assert_array_equal(np.asarray(live[:-2], np.float64), got[:-2])
        assert not np.any(np.asarray(live[-2:]))
    assert calls


@pytest.mark.parametrize("zero_points", [False, True])
def test_weight_only_int8_layers_of_bfloat16_models_on_amx(monkeypatch, zero_points):
    """A weight-only int8 layer (one scale per column) of a bfloat16 model holds its codes packed as W8A8's and
    runs on AMX tiles with x as it is: float64 of x @ (codes * scales - offsets) + bias, to one bfloat16
    rounding, for decode-sized and prompt-sized steps; a float32 model keeps the other path."""
    from paged.kernels import cpu
    from paged.models.linear import packs_int8_weights_for_amx
    if not cpu.int8_weights_on_amx():
        pytest.skip("no AMX tiles here")
    calls = []
    real = cpu.int8_weights_matmul_packed_cpu
    monkeypatch.setattr(cpu, "int8_weights_matmul_packed_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    _, params = _w8a8("int8", 96, 128, seed=12, zero_points=zero_points)
    quant = WeightQuant(bits=8, group_size=-1)
    assert packs_int8_weights_for_amx("cpu", quant, jnp.bfloat16, 128)
    assert not packs_int8_weights_for_amx("cpu", quant, jnp.float32, 128)
    layer = Linear(128, jnp.bfloat16, use_bias=True, backend="cpu", quant=quant)
    declared = nn.unbox(layer.init(jax.random.key(0), jnp.ones((2, 96), jnp.bfloat16))["params"])
    assert declared["qweight"].shape == (2, 2, 4096)
    rng = np.random.default_rng(13)
    held = {**{k: v.astype(declared[k].dtype) for k, v in params.items()},
            "qweight": cpu.pack_for_amx(params["qweight"]), "bias": jnp.asarray(rng.normal(size=128), jnp.bfloat16)}
    w = (np.asarray(params["qweight"], np.float64) * np.asarray(held["scales"], np.float64)
         - np.asarray(held["zero_offsets"], np.float64))
    for rows in (3, 133):
        x = jnp.asarray(rng.normal(size=(rows, 96)), jnp.bfloat16)
        got = np.asarray(jax.jit(lambda p, x: layer.apply({"params": p}, x))(held, x), np.float64)
        want = np.asarray(x, np.float64) @ w + np.asarray(held["bias"], np.float64)
        np.testing.assert_allclose(got, want, rtol=8e-3, atol=8e-3 * np.abs(want).max())
    assert calls


def _gated_mlp(quant: WeightQuant, dtype):
    """A gated MLP's first half over two quantized Linears (gate, up) on the "cpu" backend: through silu_gated
    (fused=True) or as the two layers and XLA's silu."""
    from paged.models.linear import silu_gated

    class Gated(nn.Module):
        fused: bool

        @nn.compact
        def __call__(self, x):
            gate, up = (Linear(128, dtype, backend="cpu", quant=quant, name=n) for n in ("gate", "up"))
            return silu_gated(x, gate, up) if self.fused else jax.nn.silu(gate(x)) * up(x)

    return Gated


@pytest.mark.parametrize("weight_only", [False, True], ids=["w8a8", "weight-only-int8"])
def test_a_gated_mlp_of_int8_layers_on_amx_is_one_call(monkeypatch, weight_only):
    """silu_gated over two int8 layers held for AMX makes one native call (W8A8: x quantized once; weight-only
    int8 of a bfloat16 model: x as it is), the activation applied to the float32 sums, matching the two layers'
    own outputs through XLA's silu to the rounding of those outputs (float32 for W8A8, bfloat16 for the
    weight-only layers)."""
    from paged.kernels import cpu
    if not (cpu.int8_weights_on_amx() if weight_only else cpu.w8a8_on_amx()):
        pytest.skip("no AMX tiles here")
    quant = WeightQuant(bits=8, group_size=-1) if weight_only else _w8a8("int8", 96, 128, seed=8)[0]
    dtype = jnp.bfloat16 if weight_only else jnp.float32
    Gated = _gated_mlp(quant, dtype)

    calls = []
    real = cpu.w8a8_gated_matmul_packed_cpu
    monkeypatch.setattr(cpu, "w8a8_gated_matmul_packed_cpu", lambda *a, **k: calls.append(k) or real(*a, **k))
    params = {name: {**{k: v.astype(dtype) for k, v in p.items() if k != "qweight"},
                     "qweight": cpu.pack_for_amx(p["qweight"])}
              for name, p in (("gate", _w8a8("int8", 96, 128, seed=9, zero_points=True)[1]),
                              ("up", _w8a8("int8", 96, 128, seed=10, zero_points=True)[1]))}
    x = jnp.asarray(np.random.default_rng(11).normal(size=(2, 5, 96)), dtype)
    fused = np.asarray(Gated(True).apply({"params": params}, x), np.float64)
    assert len(calls) == 1 and calls[0]["weight_only"] == weight_only and fused.shape == (2, 5, 128)
    separate = np.asarray(Gated(False).apply({"params": params}, x), np.float64)
    tolerance = 2e-2 if weight_only else 1e-5
    np.testing.assert_allclose(fused, separate, rtol=tolerance, atol=tolerance * np.abs(separate).max())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_gated_mlp_of_w8a8_layers_on_vnni_is_one_call(monkeypatch, dtype):
    """Without AMX-INT8 (on a CPU with it, as if it had none) silu_gated over two W8A8 layers makes one native
    call from `cpu.INT8_MATMUL_MIN_ROWS` rows: x quantized once, the activation applied to the float32 sums and
    rounded once, matching the two layers' own outputs through XLA's silu to the rounding of those outputs.
    Below those rows the layers keep their own path (no call)."""
    from paged.kernels import cpu
    if not cpu.int8_matmul_is_vectorized():
        pytest.skip("no AVX-512 VNNI here: W8A8 keeps the float path on this CPU")
    monkeypatch.setattr(cpu, "w8a8_on_amx", lambda: False)
    Gated = _gated_mlp(_w8a8("int8", 96, 128, seed=8)[0], dtype)

    calls = []
    real = cpu.w8a8_gated_matmul_cpu
    monkeypatch.setattr(cpu, "w8a8_gated_matmul_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    params = {name: p for name, p in (("gate", _w8a8("int8", 96, 128, seed=9, zero_points=True)[1]),
                                      ("up", _w8a8("int8", 96, 128, seed=10, zero_points=True)[1]))}
    rows = cpu.INT8_MATMUL_MIN_ROWS
    for shape, fused_call in (((2, rows // 2 + 1, 96), True), ((1, rows - 1, 96), False)):
        calls.clear()
        x = jnp.asarray(np.random.default_rng(11).normal(size=shape), dtype)
        fused = np.asarray(Gated(True).apply({"params": params}, x).astype(jnp.float32), np.float64)
        assert bool(calls) == fused_call and fused.shape == (*shape[:2], 128)
        separate = np.asarray(Gated(False).apply({"params": params}, x).astype(jnp.float32), np.float64)
        tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-5
        np.testing.assert_allclose(fused, separate, rtol=tolerance, atol=tolerance * np.abs(separate).max())


def test_only_layers_whose_scales_factor_out_take_it():
    quant, params = _w8a8("int8", 64, 64, seed=0)
    assert low_precision_dot.takes(quant, params)
    grouped = {**params, "scales": jnp.ones((4, 64)), "zero_offsets": jnp.zeros((4, 64))}
    assert not low_precision_dot.takes(quant, grouped)                         # scales per group of rows
    assert not low_precision_dot.takes(quant, {**params, "perm": jnp.arange(64)})  # act order
    weight_only = WeightQuant(bits=8, group_size=-1)
    assert not low_precision_dot.takes(weight_only, params)                    # activations stay float
    int4 = WeightQuant(bits=4, group_size=-1, activations="int8")
    assert not low_precision_dot.takes(int4, {**params, "qweight": jnp.zeros((32, 64), jnp.uint8)})
    fp8_quant, fp8_params = _w8a8("fp8", 64, 64, seed=0)
    block = {**fp8_params, "scales": jnp.ones((2, 64))}                        # 128 x 128-style blocks
    assert low_precision_dot.takes(fp8_quant, fp8_params) and not low_precision_dot.takes(fp8_quant, block)


def test_the_cpu_keeps_the_float_path():
    if jax.default_backend() != "cpu":
        pytest.skip("a CPU-only check")
    assert not low_precision_dot.platform_dot("int8") and not low_precision_dot.platform_dot("fp8")


def _lowered_linear(kind: str, platform: str, monkeypatch, low_precision: bool) -> str:
    """The StableHLO of a W8A8 Linear's forward, lowered for `platform` with the platform check answering
    `low_precision` (this host is a CPU: the check reads the default backend)."""
    monkeypatch.setattr(low_precision_dot, "platform_dot", lambda _: low_precision)
    quant, params = _w8a8(kind, 64, 128, seed=3)
    layer = Linear(128, jnp.bfloat16, quant=quant)
    x = jnp.ones((8, 64), jnp.bfloat16)
    shapes = nn.unbox(layer.init(jax.random.key(0), x)["params"])
    assert {k: v.shape for k, v in shapes.items()} == {k: v.shape for k, v in params.items()}
    params = {k: v.astype(shapes[k].dtype) for k, v in params.items()}  # int scales in the compute dtype
    forward = jax.jit(lambda p, x: layer.apply({"params": p}, x))
    return forward.trace(params, x).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_int8_w8a8_lowers_to_an_int8_dot(monkeypatch, platform):
    text = _lowered_linear("int8", platform, monkeypatch, low_precision=True)
    assert INT8_DOT.search(text), "no int8 x int8 -> int32 dot in the lowered module"
    assert not INT8_DOT.search(_lowered_linear("int8", platform, monkeypatch, low_precision=False))


def test_fp8_w8a8_lowers_to_an_fp8_dot_for_gpus(monkeypatch):
    text = _lowered_linear("fp8", "cuda", monkeypatch, low_precision=True)
    assert FP8_DOT.search(text), "no e4m3 x e4m3 -> float32 dot in the lowered module"
    assert not FP8_DOT.search(_lowered_linear("fp8", "cuda", monkeypatch, low_precision=False))
