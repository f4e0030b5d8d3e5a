"""Weight-only quantized linear layers: one layout in device memory for every checkpoint format.

Whatever the checkpoint (GPTQ, AWQ, or a float one quantized online), a quantized `Linear` holds:
    qweight       int8 [in, out] (8 bits), or uint8 [in / 2, out] (4 bits: rows 2i and 2i + 1 in the low and
                  high nibble of byte row i); the values are q - 2^(bits - 1), centred so 8 bits fit int8
    scales        [groups, out] in the compute dtype
    zero_offsets  [groups, out] in the compute dtype: scale * (zero - 2^(bits - 1)), so that
                  W[i, o] = qweight[i, o] * scales[g, o] - zero_offsets[g, o] for the group g of row i
    perm          int32 [in] (only with act_order): the checkpoint's input rows reordered so that each group is
                  contiguous; the layer reads x[..., perm] (GPTQ's desc_act, where g_idx is not sorted)
Groups are `group_size` consecutive input rows (group_size == in: one scale per output channel).

float8 weights (HF "fp8" checkpoints, online fp8) hold instead:
    qweight       float8_e4m3fn [in, out]
    scales        float32 [in / group_size, out / block_out]: one per block of group_size x block_out weights
                  (128 x 128 in the FP8 releases, in x 1 per output channel online); W = qweight * scale

The checkpoint formats convert to it once, on the host, at load time (models/quantized_checkpoints.py); the
matmul dequantizes inside the jitted step (`dequantize`), so weights stay quantized in memory.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

QUANT_BITS = (4, 8)


@dataclasses.dataclass(frozen=True)
class WeightQuant:
    """How a model's linear layers are quantized (a model-wide setting, as checkpoints write it).

    bits: 4 or 8. group_size: input rows per scale, or -1 for one scale per output channel.
    act_order: input rows are permuted (`perm`) so that groups are contiguous.
    method: the format it came from ("gptq", "awq", "int8"), for messages.
    """

    bits: int
    group_size: int
    act_order: bool = False
    method: str = "int8"
    kind: str = "int"  # or "float8" (e4m3 codes, block scales, no zero points)
    block_out: int = 1  # float8: output columns per scale
    # W8A8: activations quantized per token on the fly ("int8" or "fp8"), `quantize_activations`; None: they
    # stay in the compute dtype (weight-only).
    activations: str | None = None

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else in_features // self.group_size

    def group_rows(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def check(self, in_features: int, name: str, out_features: int | None = None) -> None:
        """Raises ValueError when the layer cannot be split into this scheme's groups (or nibble pairs)."""
        if out_features is not None and out_features % self.block_out:
            raise ValueError(f"{name}: weight block of {self.block_out} output columns ({self.method}) does not "
                             f"divide the output dimension {out_features}")
        if self.group_size != -1 and in_features % self.group_size:
            raise ValueError(f"{name}: group_size {self.group_size} ({self.method}) does not divide the input "
                             f"dimension {in_features}")
        if self.bits == 4 and in_features % 2:
            raise ValueError(f"{name}: 4-bit weights need an even input dimension, got {in_features}")

    def param_shapes(self, in_features: int, out_features: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (shape, dtype name or "compute") of the layer's parameters."""
        groups = self.num_groups(in_features)
        if self.kind == "float8":
            return {"qweight": ((in_features, out_features), "float8_e4m3fn"),
                    "scales": ((groups, out_features // self.block_out), "float32")}
        qweight = ((in_features, out_features), "int8") if self.bits == 8 else \
            ((in_features // 2, out_features), "uint8")
        shapes = {"qweight": qweight, "scales": ((groups, out_features), "compute"),
                  "zero_offsets": ((groups, out_features), "compute")}
        if self.act_order:
            shapes["perm"] = ((in_features,), "int32")
        return shapes


def dequantize(qweight: jax.Array, scales: jax.Array, zero_offsets: jax.Array, bits: int) -> jax.Array:
    """The float kernel [in, out] in the scales' dtype (see the module docstring for the layout)."""
    if bits == 4:
        low = (qweight & 0xF).astype(jnp.int8) - 8
        high = (qweight >> 4).astype(jnp.int8) - 8
        q = jnp.stack([low, high], axis=1).reshape(qweight.shape[0] * 2, qweight.shape[1])
    else:
        q = qweight
    groups, out = scales.shape
    q = q.reshape(groups, -1, out).astype(scales.dtype)
    return (q * scales[:, None, :] - zero_offsets[:, None, :]).reshape(-1, out)


def dequantize_float8(qweight: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """The float kernel [in, out] in `dtype` of float8 codes [in, out] and block scales [in / bi, out / bo]."""
    (rows, cols), (row_blocks, col_blocks) = qweight.shape, scales.shape
    q = qweight.astype(jnp.float32).reshape(row_blocks, rows // row_blocks, col_blocks, cols // col_blocks)
    return (q * scales[:, None, :, None]).reshape(rows, cols).astype(dtype)


def quantize_activations(x: jax.Array, kind: str) -> jax.Array:
    """x [..., K] through dynamic per-token quantization and back (W8A8's activations), as compressed-tensors
    defines it: one symmetric scale per row, max |x| / 127.5 for int8 (codes rounded half to even and clamped
    to [-128, 127]) or max |x| / 448 for fp8 e4m3 (codes rounded by the cast). The matmul then sees exactly the
    values an int8 or fp8 GEMM multiplies."""
    codes, scale = activation_codes(x, kind)
    return (codes.astype(jnp.float32) * scale).astype(x.dtype)


def activation_codes(x: jax.Array, kind: str) -> tuple[jax.Array, jax.Array]:
    """`quantize_activations`' codes (int8, or float8_e4m3fn, [..., K]) and float32 scales [..., 1]: x is
    about codes * scale, and an int8 / fp8 dot multiplies the codes as they are."""
    x32 = x.astype(jnp.float32)
    peak = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    # Both divisions must be true ones, as in the library: XLA turns a division by a constant or by a broadcast
    # row value into a multiplication by its reciprocal, whose rounding moves a row's largest value from 127.5
    # (code -128) to 127.4999 (code -127). Divisors of the full shape, behind a barrier, keep the divisions.
    bound = jax.lax.optimization_barrier(jnp.full_like(peak, 127.5 if kind == "int8" else 448.0))
    scale = peak / bound
    scale = jnp.where(scale == 0, jnp.finfo(jnp.float32).eps, scale)
    wide = jax.lax.optimization_barrier(jnp.broadcast_to(scale, x32.shape))
    if kind == "int8":
        codes = jnp.clip(jnp.round(x32 / wide), -128, 127).astype(jnp.int8)
    else:
        codes = jnp.clip(x32 / wide, -448, 448).astype(jnp.float8_e4m3fn)
    return codes, scale


# ---- host-side packing into the layout (numpy) ----------------------------------------------------------

def pack(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, bits: int, dtype,
         perm: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The layer's parameters from unsigned codes q [in, out] in [0, 2^bits), zero points [groups, out] (any
    real value) and scales [groups, out], rows already in group order (perm: the checkpoint rows they came
    from)."""
    centre = 1 << (bits - 1)
    codes = (q.astype(np.int16) - centre)
    if bits == 8:
        qweight = codes.astype(np.int8)
    else:
        nibbles = (codes + 8).astype(np.uint8)
        qweight = (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)
    scales32 = scales.astype(np.float32)
    out = {"qweight": qweight, "scales": scales32.astype(dtype),
           "zero_offsets": (scales32 * (zeros.astype(np.float32) - centre)).astype(dtype)}
    if perm is not None:
        out["perm"] = perm.astype(np.int32)
    return out


def quantize_per_channel_float8(kernel: np.ndarray) -> dict[str, np.ndarray]:
    """Online fp8 (vLLM's quantization="fp8" on a float checkpoint, weights per output channel): e4m3 codes of
    kernel / scale, scale = max |column| / 448 (e4m3's largest finite value), rounded to nearest."""
    import ml_dtypes
    w = kernel.astype(np.float32)
    scales = np.maximum(np.abs(w).max(axis=0, keepdims=True), np.finfo(np.float32).tiny) / 448.0
    return {"qweight": (w / scales).astype(ml_dtypes.float8_e4m3fn), "scales": scales.astype(np.float32)}


def quantize_per_channel_int8(kernel: np.ndarray, dtype) -> dict[str, np.ndarray]:
    """Online int8 (vLLM's weight-only int8): symmetric, one scale per output channel, round to nearest.
    kernel float [in, out]."""
    w = kernel.astype(np.float32)
    scales = np.maximum(np.abs(w).max(axis=0, keepdims=True), np.finfo(np.float32).tiny) / 127.0
    q = np.clip(np.rint(w / scales), -127, 127).astype(np.int16) + 128
    return pack(q, np.full_like(scales, 128.0), scales, 8, dtype)
