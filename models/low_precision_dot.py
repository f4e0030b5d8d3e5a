"""W8A8 products as the hardware's own low-precision dot, where the platform has one.

A W8A8 layer (compressed-tensors int-quantized or float-quantized with dynamic per-token input activations)
multiplies activation codes by weight codes. On a CPU with AMX-INT8 and the "cpu" linear backend, int8 layers
with one scale per column hold their codes packed for the tiles and never come here (models/linear.py:
packs_w8a8_for_amx). With AVX-512 VNNI instead, int8 codes of prompt-sized steps go to the native integer
matmul (`paged.kernels.cpu.int8_matmul_cpu`); otherwise on CPU the engine quantizes the activations and back
and runs the weight-only path (`quantize_activations`, models/linear.py). On a GPU or a TPU,
XLA's dot takes the codes themselves:
    int8  x int8  -> int32    (TPUs; NVIDIA GPUs from Turing on, through cuBLASLt)
    e4m3  x e4m3  -> float32  (NVIDIA GPUs of compute capability 8.9 and up: Ada, Hopper)
and the scales meet the product once, per row (the activations') and per column (the weights'):
    y[m, n] = (sum_k xq[m, k] * wq[k, n]) * sx[m] * sw[n]
which is the float path's value without its rounding of every dequantized weight and activation. Only layers
whose weight scales factor out of the sum take it: one scale per output column (or one for the tensor), no
zero points, no act-order permutation; the rest keep the float path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged.kernels import cpu
from paged.models.quantization import WeightQuant, activation_codes

# Platforms (jax.default_backend()) whose XLA dot runs int8 codes natively.
INT8_DOT_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


def platform_dot(kind: str) -> bool:
    """Whether this process's default platform multiplies `kind` ("int8" or "fp8") codes in its dot: int8 on
    GPUs and TPUs, fp8 e4m3 on NVIDIA GPUs of compute capability 8.9 or more."""
    backend = jax.default_backend()
    if kind == "int8":
        return backend in INT8_DOT_PLATFORMS
    if backend not in ("gpu", "cuda"):
        return False
    capability = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return capability is not None and tuple(int(p) for p in str(capability).split(".")[:2]) >= (8, 9)
    except ValueError:
        return False


def takes(quant: WeightQuant, params: dict[str, jax.Array]) -> bool:
    """Whether a W8A8 layer's weight scales factor out of its sum (see the module docstring), so that the
    low-precision dot computes it."""
    if quant.activations is None or "perm" in params or params["scales"].shape[0] != 1:
        return False
    if quant.activations == "int8":
        return quant.kind == "int" and quant.bits == 8 and params["qweight"].dtype == jnp.int8
    return quant.activations == "fp8" and quant.kind == "float8"


def route(quant: WeightQuant, params: dict[str, jax.Array], backend: str, rows: int) -> str | None:
    """How a layer's W8A8 product of `rows` rows runs: "native" (the CPU's int8 kernel, from
    `cpu.INT8_MATMUL_MIN_ROWS` rows: below, the weight-only quantized matmul on the activations quantized and
    back is faster), "dot" (XLA's low-precision dot on a GPU or TPU), or None (the codes dequantized)."""
    if not takes(quant, params):
        return None
    in_features, out_features = params["qweight"].shape
    if (quant.activations == "int8" and backend == "cpu" and cpu.int8_matmul_is_vectorized()
            and in_features % 4 == 0 and out_features % 64 == 0):
        return "native" if rows >= cpu.INT8_MATMUL_MIN_ROWS else None
    return "dot" if platform_dot(quant.activations) else None


def native_rows(x: jax.Array) -> jax.Array:
    """x [..., K] as the CPU's W8A8 calls take it: [rows, K] in float32 or bfloat16 (other dtypes in float32,
    where activation_codes quantizes them too)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.dtype in (jnp.float32, jnp.bfloat16) else rows.astype(jnp.float32)


def native_result_dtype(dtype) -> jnp.dtype:
    """The result dtype a CPU W8A8 call is asked for when the layer wants `dtype`: bfloat16 as it is (rounded
    once in the call), anything else in float32 and converted after."""
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(jnp.float32)


def w8a8_dot(x: jax.Array, params: dict[str, jax.Array], quant: WeightQuant, out_dtype=None, *,
             native: bool = False, live_rows: jax.Array | None = None, bias: jax.Array | None = None) -> jax.Array:
    """x [..., K] (the layer's input, not yet quantized) @ the layer's W8A8 weights, by XLA's low-precision dot
    or, with `native`, the CPU's int8 kernel (`route`), in `out_dtype` (default x's). Only where
    `takes(quant, params)`. bias: only with `native`, which adds it in the call (the caller adds it otherwise).

    params: qweight int8 [K, N] with scales [1, N] and zero_offsets [1, N] (models/quantization.py; the
    offsets of a symmetric checkpoint are zeros, and are subtracted as (sum_k x[m, k]) * offset[n]), or
    qweight float8_e4m3fn [K, N] with float32 scales [1, N / block_out].
    """
    qweight, scales = params["qweight"], params["scales"].astype(jnp.float32)
    if native:  # one call: x quantized, scales, zero points, bias and rounding; rows from live_rows on zeros
        out_dtype = jnp.dtype(out_dtype or x.dtype)
        y = cpu.w8a8_matmul_cpu(native_rows(x), qweight, scales[0], params["zero_offsets"][0], live_rows, bias=bias,
                                out_dtype=native_result_dtype(out_dtype))
        return y.reshape(*x.shape[:-1], qweight.shape[1]).astype(out_dtype)
    if bias is not None:
        raise ValueError("w8a8_dot: a bias is added in the call only with native=True")
    codes, row_scale = activation_codes(x, quant.activations)
    accumulate = jnp.int32 if quant.activations == "int8" else jnp.float32
    dims = (((codes.ndim - 1,), (0,)), ((), ()))
    sums = jax.lax.dot_general(codes, qweight, dims, preferred_element_type=accumulate).astype(jnp.float32)
    column_scale = jnp.repeat(scales[0], qweight.shape[1] // scales.shape[1])
    y = sums * row_scale * column_scale
    if quant.kind != "float8":
        # Zero points (asymmetric weights): W = q * scale - offset, so x W = x (q scale) - (sum_k x) offset, with
        # x the dequantized activations, as the float path has them.
        dequantized_sums = jnp.sum(codes.astype(jnp.float32), axis=-1, keepdims=True) * row_scale
        y = y - dequantized_sums * params["zero_offsets"].astype(jnp.float32)[0]
    return y.astype(out_dtype or x.dtype)
