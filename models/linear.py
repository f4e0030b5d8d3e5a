"""The one linear layer every projection goes through: `Linear`, `GroupedLinear` (MoE experts), `Embedding`.

Each module owns three things, so that tensor parallelism and quantized weights attach here and nowhere else:
- the parameter layout: a float `kernel` [in, out] (HF's [out, in] transposed once at load time) and an
  optional `bias` [out]. The "cpu" backend holds a bfloat16 kernel on a CPU with AMX packed into the tiles'
  order instead ([out / 64, ceil(in / 32), 2048], `paged.kernels.cpu.pack_for_amx`): the loader packs it once
  (`to_declared_layout`), so a decode step streams the weights as stored rather than re-packing each;
- the logical sharding of its weight, named by mesh axes (`TENSOR_AXIS`), never by devices: "column"
  splits the output features (q/k/v, gate/up, the LM head), "row" the input features (o, down), "replicated"
  neither. The partition specs ride on the parameters as `flax.linen.Partitioned` metadata at init, so
  `paged.models.loader.partition_specs(model)` reads them from the modules' own init, as the loader reads the shapes;
- which matmul runs (`LINEAR_BACKENDS`): XLA's dot, or the native CPU matmul for decode-sized steps.

`live_rows` is the step's count of real rows (int32 scalar, may be traced): rows from it on are the buckets'
padding, whose outputs nobody reads. A backend may skip them (the native matmul does: its rows come back as
zeros); XLA's dot computes them.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from paged.models import low_precision_dot
from paged.models.quantization import WeightQuant, dequantize, dequantize_float8, quantize_activations
from paged.kernels import cpu
from paged.kernels.cpu import screen as greedy_screening

TENSOR_AXIS = "tensor"  # the mesh axis tensor parallelism splits weights over
PARALLEL_STYLES = ("column", "row", "replicated")

# Rows per tile of the CPU grouped matmul: large enough for an efficient matmul, small enough that padding
# each expert's group to a tile boundary (at most TILE_ROWS - 1 rows per expert) stays cheap.
TILE_ROWS = 16


def kernel_axes(parallel: str, ndim: int = 2) -> tuple[str | None, ...]:
    """Mesh axis per kernel dimension ([..., in, out]; leading dims, e.g. experts, are not split)."""
    if parallel not in PARALLEL_STYLES:
        raise ValueError(f"parallel must be one of {PARALLEL_STYLES}, got {parallel!r}")
    split = {"column": (None, TENSOR_AXIS), "row": (TENSOR_AXIS, None), "replicated": (None, None)}[parallel]
    return (None,) * (ndim - 2) + split


def packs_for_amx(backend: str, dtype: Any, out_features: int) -> bool:
    """Whether a float kernel is held in the AMX layout: the native backend, bfloat16, whole 64-column panels,
    on a CPU (and OS) that offers AMX tiles. The native backend never runs sharded (paged.kernels.platform),
    so the packed layout never meets a mesh."""
    return (backend == "cpu" and jnp.dtype(dtype) == jnp.bfloat16 and out_features % cpu.AMX_PANEL == 0
            and cpu.matmul_on_amx())


def _int8_codes_fit_amx(backend: str, quant: WeightQuant | None, out_features: int) -> bool:
    """What both int8 layouts for AMX need: the native backend, int8 codes with one scale per output column, no
    act-order, whole 64-column panels. Never under a mesh (as `packs_for_amx`)."""
    return (backend == "cpu" and quant is not None and quant.kind == "int" and quant.bits == 8
            and quant.group_size == -1 and not quant.act_order and out_features % cpu.AMX_PANEL == 0)


def packs_w8a8_for_amx(backend: str, quant: WeightQuant | None, out_features: int) -> bool:
    """Whether a W8A8 layer's int8 codes are held in the AMX-INT8 layout (`cpu.pack_for_amx`) and multiplied
    there with x quantized in the call (`cpu.w8a8_matmul_packed_cpu`), at every step size: codes that fit
    (`_int8_codes_fit_amx`), activations quantized per token, on a CPU (and OS) that offers AMX-INT8 tiles."""
    return (_int8_codes_fit_amx(backend, quant, out_features) and quant.activations == "int8"
            and cpu.w8a8_on_amx())


def packs_int8_weights_for_amx(backend: str, quant: WeightQuant | None, dtype: Any, out_features: int) -> bool:
    """Whether a weight-only int8 layer of a bfloat16 model holds its codes in the AMX-INT8 layout, as W8A8's,
    and runs on AMX tiles (`cpu.int8_weights_matmul_packed_cpu`: x as int8 digits at decode sizes, the codes
    widened to bfloat16 for prompts), at every step size: codes that fit (`_int8_codes_fit_amx`), on a CPU
    that offers AMX."""
    return (_int8_codes_fit_amx(backend, quant, out_features) and quant.activations is None
            and jnp.dtype(dtype) == jnp.bfloat16 and cpu.int8_weights_on_amx())


def packs_int4_for_amx(backend: str, quant: WeightQuant | None, dtype: Any, out_features: int) -> bool:
    """Whether a weight-only int4 layer (GPTQ, AWQ, compressed-tensors pack-quantized) of a bfloat16 model holds
    its codes packed for the AMX-INT8 tiles (`cpu.pack_int4_for_amx`) and runs there with x as int8 digits
    (`cpu.int4_matmul_packed_cpu`), at every step size: the native backend, groups of a multiple of 64 rows
    (or one per column), no act-order, whole 64-column panels, on a CPU that offers AMX-INT8. Never under a
    mesh (as `packs_for_amx`)."""
    return (backend == "cpu" and quant is not None and quant.kind == "int" and quant.bits == 4
            and (quant.group_size == -1 or quant.group_size % 64 == 0) and not quant.act_order
            and quant.activations is None and out_features % cpu.AMX_PANEL == 0
            and jnp.dtype(dtype) == jnp.bfloat16 and cpu.int4_on_amx())


def to_declared_layout(tensor, want: tuple[int, ...]):
    """A checkpoint kernel [in, out] (numpy) in the layout its module declared, `want` being the parameter's
    shape: as it is, or packed for AMX when the declared shape is the packed one (bfloat16 kernels, int8 codes,
    and int4 codes [in / 2, out] uint8; other tensors unchanged)."""
    if (tensor.ndim == 2 and tensor.dtype == np.uint8 and len(want) == 3 and tensor.shape[1] % cpu.AMX_PANEL == 0
            and tuple(want) == cpu.amx_int4_packed_shape(2 * tensor.shape[0], tensor.shape[1])):
        return cpu.pack_int4_for_amx(tensor)
    if (tensor.ndim == 2 and len(want) == 3 and tensor.shape[1] % cpu.AMX_PANEL == 0
            and tuple(want) == cpu.amx_packed_shape(*tensor.shape, tensor.dtype)):
        return cpu.pack_for_amx(tensor)  # int8 codes (W8A8) in the int8 layout, any float kernel in bfloat16's
    return tensor  # a shape that fits neither layout is the caller's to report


def xla_matmul(x: jax.Array, kernel: jax.Array, live_rows: jax.Array | None = None,
               preferred_element_type: Any = None) -> jax.Array:
    """x [..., K] @ kernel [K, N] by XLA's dot, in `preferred_element_type` (default x's dtype); every row is
    computed.

    The dot always accumulates in float32 and rounds once at the end: XLA's CPU dot has a fast bfloat16 path
    only for a float32 result (bf16 in, bf16 out ran decode-sized products at 13 GFLOP/s against 206 for bf16
    in, f32 out on the benchmark CPU), and one rounding per output is what transformers' bf16 matmuls do.
    """
    del live_rows
    out_dtype = preferred_element_type or x.dtype
    y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def native_cpu_matmul(x: jax.Array, kernel: jax.Array, live_rows: jax.Array | None = None,
                      preferred_element_type: Any = None) -> jax.Array:
    """The native CPU matmul (pallas_kernels/cpu/matmul.cc) where it wins, XLA's dot elsewhere.

    Taken: x and kernel both float32 or both bfloat16 (K even), at most `cpu.matmul_max_rows(dtype)` rows
    (decode-sized steps; every step for bfloat16 on AMX), N a multiple of 64, and only where the kernel was built
    with that dtype's fast path.
    It accumulates in float32 (as `xla_matmul`) and rounds once to the result dtype. Rows from `live_rows` on
    come back as zeros.
    """
    rows = math.prod(x.shape[:-1])
    dtype = jnp.dtype(x.dtype)
    fits = (dtype.name in cpu.MATMUL_MAX_ROWS and kernel.dtype == dtype and kernel.ndim == 2
            and kernel.shape[1] % 64 == 0 and (dtype == jnp.float32 or kernel.shape[0] % 2 == 0))
    if fits and 0 < rows <= cpu.matmul_max_rows(dtype):
        out = cpu.matmul_cpu(x.reshape(rows, x.shape[-1]), kernel, live_rows)
        return out.reshape(*x.shape[:-1], kernel.shape[1]).astype(preferred_element_type or dtype)
    return xla_matmul(x, kernel, None, preferred_element_type)


# name -> matmul(x, kernel, live_rows, preferred_element_type); EngineConfig.linear_backend picks one.
LINEAR_BACKENDS: dict[str, Callable] = {"xla": xla_matmul, "cpu": native_cpu_matmul}


def linear_backend(name: str) -> Callable:
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear_backend {name!r}; choose one of {sorted(LINEAR_BACKENDS)}")
    return LINEAR_BACKENDS[name]


LORA_FACTORS = ("lora_a", "lora_b")  # the parameter names of a Linear's LoRA slots

# The step's LoRA slot of every packed token (int32 [T]; -1: the base model alone), set while a step is traced
# (`lora_token_slots`): every Linear built with LoRA slots reads it, so no call site passes it along.
_LORA_TOKEN_SLOTS: contextvars.ContextVar = contextvars.ContextVar("lora_token_slots", default=None)


@contextlib.contextmanager
def lora_token_slots(slots: jax.Array | None):
    """Within this block, Linear layers with LoRA slots add each token's adapter (`slots` int32 [T])."""
    token = _LORA_TOKEN_SLOTS.set(slots)
    try:
        yield
    finally:
        _LORA_TOKEN_SLOTS.reset(token)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """Each token's adapter product: x [T, in], a [in, S, R], b [S, R, out] (the scaling folded into b; both in
    the compute dtype), slots int32 [T] (-1: none) -> float32 [T, out].

    Two plain matmuls over every slot at once: x @ A as [in, S * R], the columns of other slots than the
    token's zeroed, then @ B as [S * R, out]. That is S x R extra columns per token (a few percent of the base
    product at the ranks and slot counts served), no gather of per-token factors, and XLA sees two 2-D dots
    (a batched einsum over slots ran several times slower on CPU). Both products accumulate in float32; x A is
    rounded to the compute dtype once between them (as PEFT's two layers do)."""
    in_features, num_slots, rank = a.shape
    columns = jnp.arange(num_slots * rank, dtype=jnp.int32) // rank  # the slot of each column of x A
    keep = slots[:, None] == columns[None, :]  # [T, S * R]; nothing for -1
    xa = jnp.dot(x.astype(a.dtype), a.reshape(in_features, num_slots * rank), preferred_element_type=jnp.float32)
    xa = jnp.where(keep, xa, 0.0).astype(b.dtype)
    return jnp.dot(xa, b.reshape(num_slots * rank, b.shape[-1]), preferred_element_type=jnp.float32)


class Linear(nn.Module):
    """y = x @ kernel (+ bias), computed in `dtype` (out in `out_dtype`, default `dtype`).

    Parameters: kernel [in, out] (packed for AMX where `packs_for_amx`) and, with `use_bias`, bias [out], both
    `dtype`. With `quant`, the kernel is held quantized instead (qweight, scales, zero_offsets and perm:
    models/quantization.py) and dequantized inside the step.
    """

    features: int
    dtype: Any
    use_bias: bool = False
    parallel: str = "replicated"
    backend: str = "xla"
    out_dtype: Any = None  # e.g. float32 logits from a bfloat16 LM head
    quant: WeightQuant | None = None
    lora_slots: int = 0  # LoRA adapters held at once (0: none); their factors are lora_a [in, slots, rank]
    # and lora_b [slots, rank, out]
    lora_rank: int = 0  # the largest rank they may have

    @property
    def held_packed(self) -> bool:
        """Whether the kernel is held packed for AMX (`packs_for_amx`, not quantized)."""
        return self.quant is None and packs_for_amx(self.backend, self.dtype, self.features)

    @property
    def holds_w8a8_packed(self) -> bool:
        """Whether the layer's W8A8 codes are held packed for AMX-INT8 (`packs_w8a8_for_amx`)."""
        return packs_w8a8_for_amx(self.backend, self.quant, self.features)

    @property
    def holds_int4_packed(self) -> bool:
        """Whether the layer's int4 codes are held packed for the AMX-INT8 tiles (`packs_int4_for_amx`)."""
        return packs_int4_for_amx(self.backend, self.quant, self.dtype, self.features)

    @property
    def holds_int8_packed(self) -> bool:
        """Whether the layer's int8 codes are held packed for AMX tiles: W8A8 (`holds_w8a8_packed`) or weight-only
        (`packs_int8_weights_for_amx`)."""
        return self.holds_w8a8_packed or packs_int8_weights_for_amx(self.backend, self.quant, self.dtype,
                                                                     self.features)

    @nn.compact
    def __call__(self, x: jax.Array, live_rows: jax.Array | None = None, *, packed_kernel: bool = False) -> jax.Array:
        """x @ kernel (+ bias). packed_kernel: declare the kernel and return it as a fused call that reads two
        layers' kernels reads it (`silu_gated`), without a bias: the packed kernel where `held_packed`, the int8
        or int4 codes' parameters where `holds_int8_packed` or `holds_int4_packed`, else a quantized layer's
        parameters as declared (a W8A8 layer for the AVX-512 VNNI gated call)."""
        axes = kernel_axes(self.parallel)
        if packed_kernel:
            held = self.held_packed or self.holds_int8_packed or self.holds_int4_packed
            if not (held or self.quant is not None) or self.use_bias:
                raise ValueError(f"{self.name}: packed_kernel needs a kernel held packed for AMX or quantized, and no "
                                 "bias")
            if self.held_packed:
                return self._packed_param(x.shape[-1], axes)
            if self.holds_int4_packed:
                return self._int4_params(x.shape[-1], axes)
            if self.holds_int8_packed:
                return self._w8a8_params(x.shape[-1], axes)
            return _quantized_params(self, self.quant, x.shape[-1], axes)
        if self.held_packed or self.holds_int8_packed or self.holds_int4_packed:
            if self.held_packed:
                y = self._amx_packed(x, live_rows, axes)
            elif self.holds_int4_packed:
                y = self._int4_packed(x, live_rows, axes)
            else:
                y = self._int8_packed(x, live_rows, axes)
            return self._add_lora(x, y, axes) if self.lora_slots else y
        inputs = x  # what an adapter reads: the input as given, not as the quantized product reorders it
        bias = self._bias(axes) if self.use_bias else None
        if self.quant is None:
            kernel = self.param("kernel", nn.with_partitioning(nn.initializers.lecun_normal(), axes),
                                (x.shape[-1], self.features), self.dtype)
            y = linear_backend(self.backend)(x.astype(self.dtype), kernel, live_rows, self.out_dtype)
        else:
            params = _quantized_params(self, self.quant, x.shape[-1], axes)
            if "perm" in params:  # act_order: the rows were regrouped at load; the input follows them
                x = jnp.take(x, params["perm"], axis=-1)
            route = low_precision_dot.route(self.quant, params, self.backend, math.prod(x.shape[:-1]))
            if route:  # W8A8 codes in an integer (or fp8) product: the CPU's kernel, or the platform's dot
                native = route == "native"
                y = low_precision_dot.w8a8_dot(x.astype(self.dtype), params, self.quant, self.out_dtype,
                                               native=native, live_rows=live_rows, bias=bias if native else None)
                if native:
                    bias = None  # added in the call
            else:
                if self.quant.activations:
                    x = quantize_activations(x.astype(self.dtype), self.quant.activations)
                y = quantized_matmul(self.backend, x.astype(self.dtype), params, self.quant.bits, live_rows,
                                     self.out_dtype, bias)
                bias = None  # added in the product
        if bias is not None:
            y = y + bias.astype(y.dtype)
        if self.lora_slots:
            y = self._add_lora(inputs, y, axes)
        return y

    def _add_lora(self, x: jax.Array, y: jax.Array, axes) -> jax.Array:
        """y plus each token's adapter product (slots from `lora_token_slots`; none set: y as it is). A is split
        as the kernel's input and B as its output, so a row-parallel layer's products are partial sums
        reduced with the base's. The factors are held in the compute dtype, as vLLM holds them: a decode step
        reads every slot's factors, and in float32 they cost a bfloat16 model twice the bytes."""
        in_features = x.shape[-1]
        a = self.param("lora_a", nn.with_partitioning(nn.initializers.zeros, (axes[0], None, None)),
                       (in_features, self.lora_slots, self.lora_rank), self.dtype)
        b = self.param("lora_b", nn.with_partitioning(nn.initializers.zeros, (None, None, axes[1])),
                       (self.lora_slots, self.lora_rank, self.features), self.dtype)
        slots = _LORA_TOKEN_SLOTS.get()
        if slots is None:
            return y
        lead = x.shape[:-1]
        flat = x.reshape(-1, in_features)
        adapted = lambda: (y.astype(jnp.float32)
                           + lora_delta(flat, a, b, slots).reshape(*lead, self.features)).astype(y.dtype)
        # A step of base-model requests only (the common case on a server with adapters) skips the products.
        return jax.lax.cond(jnp.any(slots >= 0), adapted, lambda: y)

    def _bias(self, axes) -> jax.Array:
        # A row-parallel layer adds its bias once, after the partial sums are reduced: replicated.
        bias_axes = (axes[-1],) if self.parallel == "column" else (None,)
        return self.param("bias", nn.with_partitioning(nn.initializers.zeros, bias_axes), (self.features,),
                          self.dtype)

    def _packed_param(self, in_features: int, axes) -> jax.Array:
        """The kernel held packed for AMX ([out / 64, ceil(in / 32), 2048]; initialised as the [in, out] kernel
        would be, then packed)."""
        init = lambda key, shape, dtype: cpu.pack_for_amx(
            nn.initializers.lecun_normal()(key, (in_features, self.features), dtype))
        return self.param("kernel", nn.with_partitioning(init, (axes[1], axes[0], None)),
                          cpu.amx_packed_shape(in_features, self.features), self.dtype)

    def _amx_packed(self, x: jax.Array, live_rows: jax.Array | None, axes) -> jax.Array:
        """x @ the kernel held packed for AMX (+ bias), on the native packed matmul. A bfloat16 result comes
        from the kernel with the bias added and rounded once (no float32 product in memory, no pass to add
        and round); any other (e.g. float32 logits) from the float32 product."""
        in_features = x.shape[-1]
        kernel = self._packed_param(in_features, axes)
        bias = self._bias(axes) if self.use_bias else None
        lead = x.shape[:-1]
        x = x.reshape(math.prod(lead), in_features).astype(jnp.bfloat16)
        out_dtype = jnp.dtype(self.out_dtype or self.dtype)
        if out_dtype == jnp.bfloat16:
            y = cpu.matmul_packed_rounded_cpu(x, kernel, None if bias is None else bias.astype(jnp.bfloat16),
                                              live_rows)
        else:
            y = cpu.matmul_packed_cpu(x, kernel, live_rows).astype(out_dtype)
            if bias is not None:
                y = y + bias.astype(out_dtype)
        return y.reshape(*lead, self.features)


    def _int8_packed(self, x: jax.Array, live_rows: jax.Array | None, axes) -> jax.Array:
        """A layer whose int8 codes are held in the AMX-INT8 layout (`holds_int8_packed`), in one native call with
        the scales, zero points and bias, rounded once to the output dtype: W8A8 with x quantized per row in the
        call, or weight-only with x as it is."""
        in_features = x.shape[-1]
        params = self._w8a8_params(in_features, axes)
        bias = self._bias(axes) if self.use_bias else None
        product = cpu.w8a8_matmul_packed_cpu if self.holds_w8a8_packed else cpu.int8_weights_matmul_packed_cpu
        y = product(w8a8_rows(x, self.dtype), params["qweight"], params["scales"], params["zero_offsets"], bias,
                    live_rows, out_dtype=self.out_dtype or self.dtype)
        return y.reshape(*x.shape[:-1], self.features)

    def _w8a8_params(self, in_features: int, axes) -> dict[str, jax.Array]:
        return _quantized_params(self, self.quant, in_features, axes,
                                 qweight_shape=cpu.amx_packed_shape(in_features, self.features, jnp.int8),
                                 vectors_dtype=jnp.float32)

    def _int4_packed(self, x: jax.Array, live_rows: jax.Array | None, axes) -> jax.Array:
        """A layer whose int4 codes are held for the AMX-INT8 tiles (`holds_int4_packed`), in one native call with
        the group scales, zero points and bias, rounded once to the output dtype."""
        params = self._int4_params(x.shape[-1], axes)
        bias = self._bias(axes) if self.use_bias else None
        y = cpu.int4_matmul_packed_cpu(w8a8_rows(x, jnp.bfloat16), params["qweight"], params["scales"],
                                       params["zero_offsets"], bias, live_rows, out_dtype=self.out_dtype or self.dtype)
        return y.reshape(*x.shape[:-1], self.features)

    def _int4_params(self, in_features: int, axes) -> dict[str, jax.Array]:
        return _quantized_params(self, self.quant, in_features, axes,
                                 qweight_shape=cpu.amx_int4_packed_shape(in_features, self.features),
                                 vectors_dtype=jnp.float32)


def w8a8_rows(x: jax.Array, dtype) -> jax.Array:
    """x [..., K] as the W8A8 AMX calls take it: [rows, K] in the layer's dtype, which the XLA path quantizes
    from, or float32 where that is neither float32 nor bfloat16 (exact: the codes are computed in float32)."""
    x = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).astype(dtype)
    return x if x.dtype in (jnp.float32, jnp.bfloat16) else x.astype(jnp.float32)


def silu_gated(x: jax.Array, gate: Linear, up: Linear, live_rows: jax.Array | None = None) -> jax.Array:
    """silu(gate(x)) * up(x), in `gate`'s dtype. Where both kernels are held packed for AMX and neither layer
    has a bias, one native call computes it (`paged.kernels.cpu.gated_matmul_packed_cpu`; for int8 layers
    `w8a8_gated_matmul_packed_cpu`, for int4 `int4_gated_matmul_packed_cpu`): the two float32 products and the
    activation pass never reach memory, and the result is rounded once. Two W8A8 layers on a CPU with AVX-512
    VNNI and no AMX-INT8 take `w8a8_gated_matmul_cpu` the same way (`_w8a8_gated_on_vnni`)."""
    plain = gate.use_bias or up.use_bias or gate.lora_slots or up.lora_slots
    if not plain and _w8a8_pair_on_vnni(gate, up):
        y = _w8a8_gated_on_vnni(x, gate, up, live_rows)
        if y is not None:
            return y
    fused = ((gate.held_packed and up.held_packed) or (gate.holds_int4_packed and up.holds_int4_packed)
             or (gate.holds_int8_packed and up.holds_int8_packed and gate.holds_w8a8_packed == up.holds_w8a8_packed))
    if not fused or plain:
        return jax.nn.silu(gate(x, live_rows)) * up(x, live_rows)
    if gate.holds_int4_packed:  # int4 codes on the int8 tiles, x written as digits once for both
        g, u = gate(x, packed_kernel=True), up(x, packed_kernel=True)
        y = cpu.int4_gated_matmul_packed_cpu(w8a8_rows(x, jnp.bfloat16), g["qweight"], g["scales"], g["zero_offsets"],
                                             u["qweight"], u["scales"], u["zero_offsets"], live_rows, gate.dtype)
        return y.reshape(*x.shape[:-1], gate.features)
    if gate.holds_int8_packed:  # int8 codes on AMX: W8A8 (x quantized once for both) or weight-only
        g, u = gate(x, packed_kernel=True), up(x, packed_kernel=True)
        y = cpu.w8a8_gated_matmul_packed_cpu(w8a8_rows(x, gate.dtype), g["qweight"], g["scales"], g["zero_offsets"],
                                             u["qweight"], u["scales"], u["zero_offsets"], live_rows, gate.dtype,
                                             weight_only=not gate.holds_w8a8_packed)
        return y.reshape(*x.shape[:-1], gate.features)
    rows, in_features = math.prod(x.shape[:-1]), x.shape[-1]
    y = cpu.gated_matmul_packed_cpu(x.reshape(rows, in_features).astype(jnp.bfloat16), gate(x, packed_kernel=True),
                                    up(x, packed_kernel=True), live_rows)
    return y.reshape(*x.shape[:-1], gate.features).astype(gate.dtype)


def _w8a8_pair_on_vnni(gate: Linear, up: Linear) -> bool:
    """Whether gate and up are W8A8 int8 layers that the "cpu" backend runs through the AVX-512 VNNI calls
    (not held for AMX tiles): then `silu_gated` can take them in one call."""
    def w8a8(layer: Linear) -> bool:
        return (layer.backend == "cpu" and layer.quant is not None and layer.quant.activations == "int8"
                and not layer.holds_int8_packed)
    return w8a8(gate) and w8a8(up) and gate.quant == up.quant and cpu.int8_matmul_is_vectorized()


def _w8a8_gated_on_vnni(x: jax.Array, gate: Linear, up: Linear, live_rows: jax.Array | None) -> jax.Array | None:
    """silu(gate(x)) * up(x) for two W8A8 layers in one native call (`cpu.w8a8_gated_matmul_cpu`: x quantized once,
    the activation applied as up's sums land, one rounding), where both would take the native W8A8 call at
    this step's rows (`low_precision_dot.route`); else None."""
    g, u = gate(x, packed_kernel=True), up(x, packed_kernel=True)
    rows = math.prod(x.shape[:-1])
    if any(low_precision_dot.route(layer.quant, params, layer.backend, rows) != "native"
           for layer, params in ((gate, g), (up, u))) or g["qweight"].shape != u["qweight"].shape:
        return None
    y = cpu.w8a8_gated_matmul_cpu(low_precision_dot.native_rows(x.astype(gate.dtype)), g["qweight"], g["scales"][0],
                                  g["zero_offsets"][0], u["qweight"], u["scales"][0], u["zero_offsets"][0], live_rows,
                                  low_precision_dot.native_result_dtype(gate.dtype))
    return y.reshape(*x.shape[:-1], gate.features).astype(gate.dtype)


def _quantized_params(module: nn.Module, quant: WeightQuant, in_features: int, axes,
                      num_groups: int | None = None, qweight_shape: tuple[int, ...] | None = None,
                      vectors_dtype=None) -> dict[str, jax.Array]:
    """Declares a quantized kernel's parameters (models/quantization.py) on `module`, with a leading axis of
    `num_groups` experts when given; `axes` are the float kernel's mesh axes (perm is replicated).
    qweight_shape: the codes held in another layout (the AMX one: [out / 64, steps, 4096], whose panels split
    the output features). vectors_dtype: the scales and zero offsets held in this dtype instead of the compute
    dtype: float32 for the AMX calls, which take them so; held in bfloat16 they cost a decode step one convert
    op per vector (14 a layer, 1.2 ms of a 39 ms int8 step at 16 sequences). The loader rounds them to the
    compute dtype first (quantization.pack), so the values are the same."""
    lead = () if num_groups is None else (num_groups,)
    params = {}
    for name, (shape, dtype) in quant.param_shapes(in_features, module.features).items():
        param_axes = (None,) * (len(lead) + 1) if name == "perm" else axes
        if name == "qweight" and qweight_shape is not None:
            shape, param_axes = qweight_shape, (axes[1], axes[0], None)
        if dtype == "compute":
            dtype = vectors_dtype or module.dtype
        params[name] = module.param(name, nn.with_partitioning(nn.initializers.zeros, param_axes), (*lead, *shape),
                                    _dtype(dtype) if isinstance(dtype, str) else dtype)
    return params


def _dtype(name: str):
    import ml_dtypes
    return jnp.dtype(getattr(ml_dtypes, name)) if name.startswith("float8") else jnp.dtype(name)


def quantized_matmul(backend: str, x: jax.Array, params: dict[str, jax.Array], bits: int,
                     live_rows: jax.Array | None, out_dtype: Any, bias: jax.Array | None = None) -> jax.Array:
    """x [..., K] @ the quantized kernel (models/quantization.py's layout) + bias, in `out_dtype` (default x's).

    With the native CPU backend, int8 and int4 codes go to the native quantized matmul as they are stored, so a
    step reads one byte (or half of one) per weight, and the layer is that one call: the zero points, the bias
    and the rounding to a bfloat16 result happen inside it. Layers it cannot take (N not a multiple of 64,
    groups that do not fit its 128-row blocks) and other backends dequantize the kernel in the step and run the
    float matmul.
    """
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    add_bias = lambda y: y if bias is None else y + bias.astype(y.dtype)
    if "zero_offsets" not in params:  # float8 codes with block scales
        return add_bias(linear_backend(backend)(x, dequantize_float8(params["qweight"], params["scales"], x.dtype),
                                                live_rows, out_dtype))
    qweight, scales, offsets = params["qweight"], params["scales"], params["zero_offsets"]
    rows = math.prod(x.shape[:-1])
    in_features, (groups, out_features) = x.shape[-1], scales.shape
    # bfloat16 x goes in as it is (the codes meet it as bfloat16 pairs, half the bytes in L1 per block). Only the
    # native backend asks: the question loads (and on first use builds) the native kernels.
    bfloat16_x = (backend == "cpu" and x.dtype == jnp.bfloat16
                  and cpu.quant_matmul_takes_bfloat16(in_features, groups))
    max_rows = cpu.MATMUL_MAX_ROWS["int4_bfloat16" if bits == 4 and bfloat16_x else "int8"]
    if backend == "cpu" and 0 < rows <= max_rows and cpu.quant_matmul_takes(in_features, out_features, groups, bits):
        x2 = x.reshape(rows, in_features)
        if not bfloat16_x:
            x2 = x2.astype(jnp.float32)
        native_out = out_dtype if out_dtype in (jnp.float32, jnp.bfloat16) else jnp.dtype(jnp.float32)
        y = cpu.quant_matmul_cpu(x2, qweight, scales, live_rows, zero_offsets=offsets, bias=bias,
                                 out_dtype=native_out)
        return y.reshape(*x.shape[:-1], out_features).astype(out_dtype)
    kernel = dequantize(qweight, scales, offsets, bits)
    return add_bias(linear_backend(backend)(x, kernel, live_rows, out_dtype))


class GroupedLinear(nn.Module):
    """Rows sorted by group times their group's matrix: the MoE experts' projections.

    Parameters: kernel [G, in, out], `dtype` (one matrix per expert); with `quant`, each expert's kernel held
    quantized instead (models/quantization.py's parameters with a leading expert axis), dequantized in the step.
    """

    features: int
    num_groups: int
    dtype: Any
    parallel: str = "replicated"
    quant: WeightQuant | None = None

    @nn.compact
    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        axes = kernel_axes(self.parallel, 3)
        if self.quant is None:
            kernel = self.param("kernel", nn.with_partitioning(nn.initializers.lecun_normal(batch_axis=(0,)), axes),
                                (self.num_groups, x.shape[-1], self.features), self.dtype)
        else:
            params = _quantized_params(self, self.quant, x.shape[-1], axes, self.num_groups)
            kernel = jax.vmap(lambda p: dequantized_kernel(p, self.quant, self.dtype))(params)
            if self.quant.activations:
                x = quantize_activations(x.astype(self.dtype), self.quant.activations)
        return grouped_matmul(x.astype(self.dtype), kernel, group_sizes)


def dequantized_kernel(params: dict[str, jax.Array], quant: WeightQuant, dtype) -> jax.Array:
    """One layer's float kernel [in, out] in `dtype` from its quantized parameters, rows in the checkpoint's
    order (act order's regrouping undone, for callers that cannot permute their input, as the experts')."""
    if quant.kind == "float8":
        return dequantize_float8(params["qweight"], params["scales"], dtype)
    kernel = dequantize(params["qweight"], params["scales"], params["zero_offsets"], quant.bits).astype(dtype)
    if "perm" in params:
        kernel = jnp.zeros_like(kernel).at[params["perm"]].set(kernel)  # row r came from checkpoint row perm[r]
    return kernel


class Embedding(nn.Module):
    """An embedding table [V, H], split over its rows (the vocabulary) unless `vocab_parallel` is off (small
    tables such as GPT-2's positions); `attend` is the tied LM head."""

    num_embeddings: int
    features: int
    dtype: Any
    vocab_parallel: bool = True
    backend: str = "xla"  # the linear backend: "cpu" runs `attend` natively where it can (below)

    def setup(self):
        axes = (TENSOR_AXIS if self.vocab_parallel else None, None)
        self.embedding = self.param("embedding", nn.with_partitioning(nn.initializers.normal(0.02), axes),
                                    (self.num_embeddings, self.features), self.dtype)

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        return self.embedding[token_ids].astype(self.dtype)

    def attend(self, h: jax.Array, live_rows: jax.Array | None = None) -> jax.Array:
        """float32 logits [S, V] of h [S, H] against the table (tied embeddings).

        With the "cpu" backend, a bfloat16 table on a CPU with AMX or AVX-512 BF16 is read as stored by the
        native transposed matmul, which computes only rows [0, live_rows) (the rest are zeros: padding rows,
        nobody reads them).
        XLA's dot computes every row, and a one-row product against a 150k-row table takes it ~10x the time
        of eight (measured in docs/kernels.md).
        """
        table = self.embedding
        if self.runs_natively(h):
            return cpu.matmul_transposed_cpu(h.astype(jnp.bfloat16), table, live_rows)
        if h.shape[0] == 1 and table.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
            # XLA's CPU dot takes a one-row bfloat16 product as a vector product that first widens the whole
            # table to float32 (545 MB at Qwen2.5-0.5B's, every decode step of one sequence): 190 ms a call
            # with glibc's allocator, 40 ms with tcmalloc, against 14.5 ms for two rows.
            two = jnp.concatenate([h, jnp.zeros_like(h)])
            return jnp.einsum("sh,vh->sv", two, table, preferred_element_type=jnp.float32)[:1]
        return jnp.einsum("sh,vh->sv", h, table, preferred_element_type=jnp.float32)

    def runs_natively(self, h: jax.Array) -> bool:
        """Whether `attend` runs on the native transposed matmul for h (the condition `attend_argmax` needs)."""
        return h.ndim == 2 and h.shape[1] % 32 == 0 and self.table_runs_natively()

    def table_runs_natively(self) -> bool:
        """Whether this table is one the native transposed matmul reads (bfloat16, a width of 32s, the cpu
        backend on a CPU with AMX or AVX-512 BF16): `runs_natively` for any h of its width."""
        return (self.backend == "cpu" and self.embedding.dtype == jnp.bfloat16 and self.embedding.ndim == 2
                and self.embedding.shape[1] % 32 == 0 and cpu.transposed_matmul_native())

    def attend_argmax(self, h: jax.Array, live_rows: jax.Array | None = None, screen: dict | None = None
                      ) -> jax.Array:
        """int32 [S]: the first argmax of `attend(h, live_rows)`'s rows (0 past live_rows), in the same pass
        over the table and without writing the [S, V] logits. Only where `runs_natively(h)`. With `screen`
        (`tied_head_screen`'s, of this table) the same tokens through the table's int8 copy."""
        if screen is not None:
            return greedy_screening.screened_argmax_cpu(h.astype(jnp.bfloat16), self.embedding, screen, live_rows)
        return cpu.matmul_transposed_argmax_cpu(h.astype(jnp.bfloat16), self.embedding, live_rows)


class LastHidden(NamedTuple):
    """What the LM head reads: h [S, H] in the model dtype (final-normed, one row per sequence) and live_rows,
    int32 []: rows from it on are padded sequences, whose logits nobody reads."""

    h: jax.Array
    live_rows: jax.Array


def tied_greedy_head(table: Embedding, table_params: dict, last: LastHidden, config, screen: dict | None = None
                     ) -> Callable[[], jax.Array] | None:
    """For a model whose LM head is `table` (tied embeddings): a function giving the first argmax of its logits
    without them (int32 [S], `Embedding.attend_argmax`, through `screen` where given), or None where no kernel
    fuses them. Also None when some table rows are not tokens (a padded vocabulary) or a final soft cap applies
    (tanh can merge distinct logits into one maximum)."""
    if not _argmax_is_the_tokens(config):
        return None
    variables = {"params": table_params}
    if not table.apply(variables, last.h, method="runs_natively"):
        return None
    return lambda: table.apply(variables, last.h, last.live_rows, screen, method="attend_argmax")


def _argmax_is_the_tokens(config) -> bool:
    """Whether the table's first argmax is the greedy token: every table row a token (no padded vocabulary) and
    no final soft cap (tanh can merge distinct logits into one maximum)."""
    return not (config.padded_vocab_size or config.final_soft_cap)


# The key of `tied_head_screen`'s arrays among a model's params (beside the weights, like the rotary tables).
GREEDY_SCREEN = "greedy_screen"


def tied_head_screen(table: Embedding, table_params: dict, config) -> dict:
    """{GREEDY_SCREEN: the int8 screen of a tied table} where the screen runs (AMX-INT8 tiles or AVX-512 VNNI: the
    tokens stay the full head's: pallas_kernels/cpu/screen.py), else {}. Built from the table's current values:
    whoever replaces the table must build it again."""
    if not (_argmax_is_the_tokens(config) and greedy_screening.screen_native()
            and table.apply({"params": table_params}, method="table_runs_natively")):
        return {}
    screen = greedy_screening.greedy_screen(table_params["embedding"])
    return {} if screen is None else {GREEDY_SCREEN: screen}


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tiled: bool | None = None) -> jax.Array:
    """Rows of `x` sorted by group times their group's matrix.

    On GPU/TPU this is `jax.lax.ragged_dot` (a native grouped GEMM there); on CPU, where jax lowers
    `ragged_dot` densely, the groups are padded to tiles of `TILE_ROWS` rows and a loop over tiles multiplies
    each tile by its one group's matrix: (M + G * TILE_ROWS) rows of work instead of M * G.

    Args:
      x: [M, K], rows of group 0 first, then group 1, ... (rows past sum(group_sizes) are ignored: zeros).
      w: [G, K, N].
      group_sizes: int32 [G].
      tiled: use the tile loop (default: on CPU) instead of `jax.lax.ragged_dot`.
    Returns:
      [M, N] in x's dtype.
    """
    if tiled is None:
        tiled = jax.default_backend() == "cpu"
    if not tiled:
        return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32
                                  ).astype(x.dtype)
    num_rows, num_groups = x.shape[0], w.shape[0]
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    padded_sizes = (group_sizes + TILE_ROWS - 1) // TILE_ROWS * TILE_ROWS
    padded_ends = jnp.cumsum(padded_sizes)
    padded_starts = padded_ends - padded_sizes
    row = jnp.arange(num_rows, dtype=jnp.int32)
    row_group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), num_groups - 1)
    real = row < ends[-1]
    dest = jnp.where(real, padded_starts[row_group] + row - starts[row_group], -1)
    num_tiles = -(-num_rows // TILE_ROWS) + num_groups  # static bound on the padded layout
    padded = jnp.zeros((num_tiles * TILE_ROWS, x.shape[1]), x.dtype).at[dest].set(x, mode="drop")
    tiles = padded.reshape(num_tiles, TILE_ROWS, x.shape[1])
    tile_group = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(num_tiles) * TILE_ROWS, side="right"),
                             num_groups - 1)
    tile_used = jnp.arange(num_tiles) * TILE_ROWS < padded_ends[-1]

    def one_tile(_, xs):
        tile, group, used = xs
        out = jax.lax.cond(used, lambda: jnp.dot(tile, w[group], preferred_element_type=jnp.float32),
                           lambda: jnp.zeros((TILE_ROWS, w.shape[2]), jnp.float32))
        return None, out.astype(x.dtype)

    _, out = jax.lax.scan(one_tile, None, (tiles, tile_group, tile_used))
    out = out.reshape(num_tiles * TILE_ROWS, w.shape[2])
    return jnp.where(real[:, None], out[jnp.maximum(dest, 0)], 0)
