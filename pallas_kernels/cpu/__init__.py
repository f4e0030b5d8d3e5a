"""Native CPU kernels as XLA FFI calls: paged attention (`paged_attention.cc`), the K/V write into the pool
(`kv_write.cc`), and the matmuls (`matmul.cc`: decode-sized float32 and bfloat16, and quantized int8/int4
weights with per-group scales), beside this file.

XLA's CPU code cannot read pages in place: the chunked path (`xla.py`) gathers every chunk of pages into a
temporary before its matmuls, and that copy plus the loop's per-op cost was 43% of the engine's device time
on the benchmark workload. This kernel walks each (token, KV head)'s pages straight from the pool, only the
keys the token can see, with the online softmax in registers, spread over XLA's intra-op threads.

The source is compiled on first use with the machine's C++ compiler (`CXX`, default `g++`) for the host
CPU (`-march=native`) and cached under `$PAGED_CACHE_DIR/kernels` (pallas_kernels/cache.py) by a hash of
the source, the compiler, the flags and jaxlib's version; `available()` says whether that worked, and why not.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from paged.kernels.cache import cache_root
from paged.kernels.reference import to_pool_dtype

_SOURCE_DIR = Path(__file__).parent
_SOURCES = (_SOURCE_DIR / "paged_attention.cc", _SOURCE_DIR / "kv_write.cc", _SOURCE_DIR / "matmul.cc",
            _SOURCE_DIR / "amx.cc", _SOURCE_DIR / "amx_attention.cc", _SOURCE_DIR / "argmax.cc",
            _SOURCE_DIR / "norm.cc", _SOURCE_DIR / "transposed.cc", _SOURCE_DIR / "int8_matmul.cc",
            _SOURCE_DIR / "amx_int8.cc", _SOURCE_DIR / "amx_int4.cc", _SOURCE_DIR / "amx_widened.cc",
            _SOURCE_DIR / "head_screen.cc")
_HEADERS = (_SOURCE_DIR / "parallel.h", _SOURCE_DIR / "bf16.h", _SOURCE_DIR / "amx.h", _SOURCE_DIR / "amx_tiles.h",
            _SOURCE_DIR / "vector_math.h", _SOURCE_DIR / "transposed.h",
            _SOURCE_DIR / "lane_argmax.h", _SOURCE_DIR / "panels.h", _SOURCE_DIR / "amx_digits.h",
            _SOURCE_DIR / "amx_int8_walk.h", _SOURCE_DIR / "amx_head.h", _SOURCE_DIR / "head_screen.h",
            _SOURCE_DIR / "vnni.h", _SOURCE_DIR / "row_codes.h")
_TARGET = "paged_attention_cpu"
_MATMUL_TARGET = "matmul_cpu"
_QUANT_MATMUL_TARGET = "quant_matmul_cpu"
_INT8_MATMUL_TARGET = "int8_matmul_cpu"
_W8A8_MATMUL_TARGET = "w8a8_matmul_cpu"
_W8A8_GATED_MATMUL_TARGET = "w8a8_gated_matmul_cpu"
_W8A8_PACKED_TARGET = "w8a8_matmul_packed_cpu"
_W8A8_GATED_TARGET = "w8a8_gated_matmul_packed_cpu"
_INT8_WEIGHTS_TARGET = "int8_weights_matmul_packed_cpu"
_INT8_WEIGHTS_GATED_TARGET = "int8_weights_gated_matmul_packed_cpu"
_INT4_PACKED_TARGET = "int4_matmul_packed_cpu"
_INT4_GATED_TARGET = "int4_gated_matmul_packed_cpu"
_MATMUL_TRANSPOSED_TARGET = "matmul_transposed_cpu"
_MATMUL_TRANSPOSED_ARGMAX_TARGET = "matmul_transposed_argmax_cpu"
_SCREENED_ARGMAX_TARGET = "screened_argmax_cpu"
_BUILD_SCREEN_TARGET = "greedy_screen_cpu"
_MATMUL_PACKED_TARGET = "matmul_packed_cpu"
_MATMUL_PACKED_ROUNDED_TARGET = "matmul_packed_rounded_cpu"
_GATED_MATMUL_PACKED_TARGET = "gated_matmul_packed_cpu"
_ARGMAX_ROWS_TARGET = "argmax_rows_cpu"
_ADD_RMS_NORM_TARGET = "add_rms_norm_cpu"
_KV_WRITE_TARGET = "write_kv_cpu"
_COPY_BLOCKS_TARGET = "copy_blocks_cpu"
_SCATTER_BLOCKS_TARGET = "scatter_blocks_cpu"
# filled by _load(): dtype (or "int8_bfloat16": codes against bf16 x) -> whether the default build has its fast path
_VECTORIZED_MATMUL: dict[str, bool] = {}
_MATMUL_ON_AMX: list[bool] = []  # filled by _load(): whether the default build's bfloat16 products run on AMX
_PROMPTS_ON_AMX: list[bool] = []  # filled by _load(): whether its bfloat16 prompt attention runs on AMX
_W8A8_ON_AMX: list[bool] = []  # filled by _load(): whether its W8A8 layers run on AMX-INT8 tiles
_INT8_WEIGHTS_ON_AMX: list[bool] = []  # filled by _load(): whether weight-only int8 layers run on AMX
_TRANSPOSED_NATIVE: list[bool] = []  # filled by _load(): whether the tied LM head's transposed calls have a kernel
# filled by _load(), for each build (target): whether its greedy head's int8 screen runs (AMX-INT8 or AVX-512 VNNI)
_SCREEN_NATIVE: dict[str, bool] = {}
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")


def _cache_dir() -> Path:
    return cache_root() / "kernels"


def _host_cpu() -> str:
    """The CPU's model and feature flags (what -march=native compiles for), as far as the OS tells."""
    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        info = ""
    return f"{platform.machine()} {platform.processor()} {info}"


def compiler() -> str | None:
    """The C++ compiler the kernels build with (`CXX`, default g++), or None when it is not on PATH."""
    name = os.environ.get("CXX", "g++")
    return name if shutil.which(name) is not None else None


def _build(flags: tuple[str, ...] = _FLAGS) -> Path:
    if compiler() is None:
        raise RuntimeError(f"no C++ compiler: {os.environ.get('CXX', 'g++')!r} is not on PATH (install g++ or "
                           "set CXX)")
    compiler_name = compiler()
    version = subprocess.run([compiler_name, "--version"], capture_output=True, text=True).stdout
    # The FFI headers come with jaxlib, and -march=native ties the code to this CPU: a library is reused only
    # with the same jaxlib on the same kind of CPU (a cache directory may be shared between machines).
    sources = [path.read_text() for path in (*_SOURCES, *_HEADERS)]
    key = hashlib.sha256("\0".join([*sources, compiler_name, version, " ".join(flags),
                                    importlib.metadata.version("jaxlib"), _host_cpu()]).encode()).hexdigest()[:16]
    library = _cache_dir() / f"paged_attention_cpu_{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        out = Path(tmp) / library.name
        compile_flags = [flag for flag in flags if flag != "-shared"]
        commands = [[compiler_name, *compile_flags, f"-I{jax.ffi.include_dir()}", "-c", str(source),
                     "-o", str(Path(tmp) / f"{source.stem}.o")] for source in _SOURCES]
        # One compiler per source, side by side: the attention kernel's instantiations take most of the
        # build, the other sources finish beside it.
        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(commands), os.cpu_count() or 1))) as pool:
            results = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), commands))
        link = [compiler_name, *flags, *(cmd[-1] for cmd in commands), "-o", str(out)]
        results.append(subprocess.run(link, capture_output=True, text=True))
        for cmd, result in zip([*commands, link], results):
            if result.returncode:
                raise RuntimeError(f"compiling {_SOURCE_DIR} failed ({' '.join(cmd)}):\n{result.stderr[-2000:]}")
        os.replace(out, library)  # atomic: concurrent builders never see a half-written library
    return library


@functools.cache
def _load(flags: tuple[str, ...] = _FLAGS, target: str = _TARGET) -> str | None:
    """Builds and registers the kernel once per process; returns None or why it is unavailable.

    Other `flags` under another `target` build a second variant (tests use it for the portable code paths
    that AVX-512 machines would otherwise never run: `-mno-avx512f`).
    """
    try:
        import ctypes

        library = ctypes.cdll.LoadLibrary(str(_build(flags)))
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(library.PagedAttentionCpu), platform="cpu")
        jax.ffi.register_ffi_target(f"{_MATMUL_TARGET}{target[len(_TARGET):]}",
                                    jax.ffi.pycapsule(library.MatmulCpu), platform="cpu")
        for name, symbol in ((_KV_WRITE_TARGET, library.WriteKvCpu), (_COPY_BLOCKS_TARGET, library.CopyBlocksCpu),
                             (_SCATTER_BLOCKS_TARGET, library.ScatterBlocksCpu),
                             (_QUANT_MATMUL_TARGET, library.QuantMatmulCpu),
                             (_INT8_MATMUL_TARGET, library.Int8MatmulCpu),
                             (_W8A8_MATMUL_TARGET, library.W8A8MatmulCpu),
                             (_W8A8_GATED_MATMUL_TARGET, library.W8A8GatedMatmulCpu),
                             (_W8A8_PACKED_TARGET, library.W8A8MatmulPackedCpu),
                             (_W8A8_GATED_TARGET, library.W8A8GatedMatmulPackedCpu),
                             (_INT8_WEIGHTS_TARGET, library.Int8WeightsMatmulPackedCpu),
                             (_INT8_WEIGHTS_GATED_TARGET, library.Int8WeightsGatedMatmulPackedCpu),
                             (_INT4_PACKED_TARGET, library.Int4MatmulPackedCpu),
                             (_INT4_GATED_TARGET, library.Int4GatedMatmulPackedCpu),
                             (_MATMUL_TRANSPOSED_TARGET, library.MatmulTransposedCpu),
                             (_MATMUL_TRANSPOSED_ARGMAX_TARGET, library.MatmulTransposedArgmaxCpu),
                             (_SCREENED_ARGMAX_TARGET, library.ScreenedArgmaxCpu),
                             (_BUILD_SCREEN_TARGET, library.BuildScreenCpu),
                             (_MATMUL_PACKED_TARGET, library.MatmulPackedCpu),
                             (_MATMUL_PACKED_ROUNDED_TARGET, library.MatmulPackedRoundedCpu),
                             (_GATED_MATMUL_PACKED_TARGET, library.GatedMatmulPackedCpu),
                             (_ARGMAX_ROWS_TARGET, library.ArgmaxRowsCpu),
                             (_ADD_RMS_NORM_TARGET, library.AddRmsNormCpu)):
            jax.ffi.register_ffi_target(f"{name}{target[len(_TARGET):]}", jax.ffi.pycapsule(symbol), platform="cpu")
        _SCREEN_NATIVE[target] = bool(library.ScreenedArgmaxIsAvailable())
        if target == _TARGET:
            _VECTORIZED_MATMUL.update(float32=bool(library.MatmulCpuIsVectorized()),
                                      bfloat16=bool(library.MatmulCpuBf16IsVectorized()),
                                      int8=bool(library.QuantMatmulCpuIsVectorized()),
                                      int8_bfloat16=bool(library.QuantMatmulCpuBf16IsVectorized()),
                                      w8a8=bool(library.Int8MatmulCpuIsVectorized()))
            _MATMUL_ON_AMX[:] = [bool(library.MatmulCpuBf16UsesAmx())]
            _PROMPTS_ON_AMX[:] = [bool(library.PromptAttentionUsesAmx())]
            _TRANSPOSED_NATIVE[:] = [bool(library.MatmulTransposedIsAvailable())]
            _W8A8_ON_AMX[:] = [bool(library.W8A8MatmulPackedIsAvailable())]
            _INT8_WEIGHTS_ON_AMX[:] = [bool(library.Int8WeightsMatmulPackedIsAvailable())]
    except Exception as error:  # noqa: BLE001 - any failure means "use the XLA path", reported by available()
        return f"{type(error).__name__}: {error}"
    return None


def available() -> tuple[bool, str]:
    """(True, "") when the native kernel is built and registered, else (False, the reason)."""
    reason = _load()
    return reason is None, reason or ""


def _require_kernels() -> None:
    ok, reason = available()
    if not ok:
        raise RuntimeError(f"the native CPU kernels are unavailable: {reason}")


def paged_attention_cpu(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    page_tables: jax.Array,
    token_seq_ids: jax.Array,
    positions: jax.Array,
    *,
    scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
    _target: str = _TARGET,
) -> jax.Array:
    """Same contract as `paged_attention_reference`, run by the native kernel (CPU only).

    Args:
      q: [T, num_q_heads, head_dim], float32 or bfloat16.
      k_cache, v_cache: [num_layers, num_kv_heads, num_blocks, block_size, head_dim], q's dtype.
      layer: int32 scalar.
      page_tables: int32 [S, P]; token_seq_ids, positions: int32 [T].
      sliding_window: None, or an int / int32 scalar (<= 0: no window), so one compiled layer body can serve
        alternating local and global layers.
      soft_cap: attention-logit soft cap, or None.
    Returns:
      [T, num_q_heads, head_dim], q's dtype.
    """
    _require_kernels()
    if q.ndim != 3 or k_cache.ndim != 5 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q [T, Hq, D] and two equal pools [L, Hkv, NB, bs, D]; got q {q.shape}, "
                         f"k_cache {k_cache.shape}, v_cache {v_cache.shape}")
    if q.shape[2] != k_cache.shape[4] or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"q {q.shape} does not fit the pool {k_cache.shape}: head_dim must match and "
                         f"num_q_heads be a multiple of num_kv_heads")
    if q.dtype not in (jnp.float32, jnp.bfloat16) or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q and the pools must share a dtype, float32 or bfloat16; got {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
    call = jax.ffi.ffi_call(_target, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_cache, v_cache, jnp.asarray(layer, jnp.int32), page_tables.astype(jnp.int32),
                token_seq_ids.astype(jnp.int32), positions.astype(jnp.int32), window,
                scale=np.float32(scale), soft_cap=np.float32(soft_cap or 0.0))


def writes_pool_natively(dtype) -> bool:
    """Whether writes into a KV pool of `dtype` (tokens and whole blocks) should go through the native calls
    here: 16-bit and float8 pools on the CPU backend. XLA's CPU scatter converts a bfloat16 or float16 operand,
    the whole pool, to float32 and back (kv_write.cc): two passes over the pool per layer per step, and for a
    pool that fills host memory a float32 copy that does not fit."""
    return jnp.dtype(dtype).itemsize in (1, 2) and jax.default_backend() == "cpu" and available()[0]


def write_kv_cpu(k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array | int, k: jax.Array, v: jax.Array,
                 slot_mapping: jax.Array, *, _target: str = _KV_WRITE_TARGET) -> tuple[jax.Array, jax.Array]:
    """Same contract as `write_kv_to_cache`, in place by the native kernel (CPU only; any 8-, 16- or 32-bit
    dtype: the kernel moves rows of bytes, the cast to the pool's dtype happens before it).

    The pools are aliased to the results: inside a jitted step with the pool donated, nothing is copied.
    """
    _require_kernels()
    if k_cache.ndim != 5 or v_cache.shape != k_cache.shape or k.ndim != 3 or v.shape != k.shape \
            or k.shape[1:] != (k_cache.shape[1], k_cache.shape[4]) or slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"expected pools [L, Hkv, NB, bs, D], new k, v [T, Hkv, D] and slot_mapping [T]; got "
                         f"{k_cache.shape}, {v_cache.shape}, {k.shape}, {v.shape}, {slot_mapping.shape}")
    if k_cache.dtype.itemsize not in (1, 2, 4):
        raise ValueError(f"write_kv_cpu takes 8-, 16- or 32-bit pools; got {k_cache.dtype}")
    call = jax.ffi.ffi_call(_target, _pools_out(k_cache, v_cache), input_output_aliases={0: 0, 1: 1})
    return call(k_cache, v_cache, jnp.asarray(layer, jnp.int32), to_pool_dtype(k, k_cache.dtype),
                to_pool_dtype(v, v_cache.dtype), slot_mapping.astype(jnp.int32))


def _pools_out(k_cache: jax.Array, v_cache: jax.Array):
    return (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))


def copy_blocks_cpu(k_cache: jax.Array, v_cache: jax.Array, src: jax.Array, dst: jax.Array
                    ) -> tuple[jax.Array, jax.Array]:
    """Block src[i] -> dst[i] of both pools [L, Hkv, NB, bs, D], every layer and head, in place (aliased).

    src, dst: int32 [n]; no destination may be another pair's source (copy-on-write never does that).
    """
    _require_kernels()
    if k_cache.ndim != 5 or v_cache.shape != k_cache.shape or src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"expected two equal pools [L, Hkv, NB, bs, D] and src, dst [n]; got {k_cache.shape}, "
                         f"{v_cache.shape}, {src.shape}, {dst.shape}")
    call = jax.ffi.ffi_call(_COPY_BLOCKS_TARGET, _pools_out(k_cache, v_cache), input_output_aliases={0: 0, 1: 1})
    return call(k_cache, v_cache, src.astype(jnp.int32), dst.astype(jnp.int32))


def scatter_blocks_cpu(k_cache: jax.Array, v_cache: jax.Array, dst: jax.Array, k_data: jax.Array,
                       v_data: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Data block i ([L, Hkv, n, bs, D], the pools' dtype) -> pool block dst[i] (int32 [n]), in place."""
    _require_kernels()
    expected = (*k_cache.shape[:2], dst.shape[0], *k_cache.shape[3:])
    if k_cache.ndim != 5 or v_cache.shape != k_cache.shape or k_data.shape != expected or v_data.shape != expected:
        raise ValueError(f"expected pools [L, Hkv, NB, bs, D] and data {list(expected)}; got {k_cache.shape}, "
                         f"{v_cache.shape}, {k_data.shape}, {v_data.shape}")
    call = jax.ffi.ffi_call(_SCATTER_BLOCKS_TARGET, _pools_out(k_cache, v_cache), input_output_aliases={0: 0, 1: 1})
    return call(k_cache, v_cache, k_data.astype(k_cache.dtype), v_data.astype(v_cache.dtype), dst.astype(jnp.int32))


# Rows up to which `matmul_cpu` beats XLA's dot (decode steps, small mixed steps); larger products stay on
# XLA, which reaches ~90% of its large-matmul rate there. GFLOP/s on a decode step's own products (8 layers'
# projections, 96 MB of weights) against XLA: 8 rows 135-163 vs 103-115, 48: 425-445 vs 305-320,
# 128: 439 vs 374, 192: 418 vs 395, 256: 408 vs 433, 512: 409 vs 436.
# bfloat16 (AVX-512 BF16) against XLA's bf16 dot with a float32 result, GFLOP/s on the 0.5B shape's products
# (896x896, 896x128, 896x4864, 4864x896; 6 of each per call): 8 rows 396 vs 160, 32: 678 vs 388, 64: 763 vs
# 419, 128: 780 vs 673, 256: 783 vs 776, 384: 627 vs 683 (benchmarks in docs/kernels.md).
# Quantized weights (int8 or int4 codes, `quant_matmul_cpu`; the key is "int8"): the alternative is dequantizing
# the whole kernel to float32 in every step, so the native call wins at prompt sizes too; on the 30M benchmark model with --quantization int8, prompt steps took
# 0.91 s of device time with it against 1.36 s when steps over 192 rows dequantized for XLA's dot.
# bfloat16 on AMX tiles (amx.cc) has no limit: on the 0.5B shape's products it beat XLA's bf16 dot (which uses
# AMX too on that CPU) at every row count measured, 8 to 2048 (docs/kernels.md).
# int4 codes with bfloat16 x stop at 1,024 rows: a full chunked-prefill step (2,048 rows) dequantizes each kernel
# to bfloat16 for XLA's dot instead, which made GPTQ int4 prompts 1.37x-1.49x faster on the EPYC machine
# (docs/performance.md, "int4 prompt steps"); up to 1,024 rows the native call ran the 0.5B shape's products
# faster than dequantizing.
MATMUL_MAX_ROWS = {"float32": 192, "bfloat16": 256, "int8": 2048, "int4_bfloat16": 1024}


def matmul_cpu(x: jax.Array, w: jax.Array, live_rows: jax.Array | int | None = None, *,
               _target: str = _MATMUL_TARGET) -> jax.Array:
    """x [M, K] @ w [K, N] by the native kernel, accumulated and returned in float32; N must be a multiple of 64.

    x, w: both float32, or both bfloat16 (then K even: the AVX-512 BF16 path multiplies pairs of k).
    live_rows: int32 scalar (may be traced); only rows [0, live_rows) are computed and the rest of the result
      is zeros (rows past a step's real tokens are padding). None: all M.
    """
    _require_kernels()
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or w.shape[1] % 64:
        raise ValueError(f"expected x [M, K] and w [K, N] with N a multiple of 64; got {x.shape} and {w.shape}")
    if x.dtype != w.dtype or x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"matmul_cpu takes two float32 or two bfloat16 operands; got {x.dtype} and {w.dtype}")
    if x.dtype == jnp.bfloat16 and x.shape[1] % 2:
        raise ValueError(f"matmul_cpu in bfloat16 needs an even K; got x {x.shape}")
    live = jnp.asarray(x.shape[0] if live_rows is None else live_rows)
    if live.shape != () or not jnp.issubdtype(live.dtype, jnp.integer):
        raise ValueError(f"live_rows must be an integer scalar; got {live.dtype}{list(live.shape)}")
    call = jax.ffi.ffi_call(_target, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32))
    return call(x, w, live.astype(jnp.int32))


def matmul_transposed_cpu(x: jax.Array, w: jax.Array, live_rows: jax.Array | int | None = None, *,
                          _target: str = _MATMUL_TRANSPOSED_TARGET) -> jax.Array:
    """x [M, K] @ w [N, K]^T, float32 [M, N]: the tied LM head against the embedding table as stored (no
    transposed copy), on AMX tiles or, without them, AVX-512 BF16 (`transposed_matmul_native()`). bfloat16
    operands, K a multiple of 32. live_rows: as for `matmul_cpu` (rows from it on are zeros)."""
    live = _check_transposed("matmul_transposed_cpu", x, w, live_rows, _target)
    call = jax.ffi.ffi_call(_target, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32))
    return call(x, w, live)


def matmul_transposed_argmax_cpu(x: jax.Array, w: jax.Array, live_rows: jax.Array | int | None = None, *,
                                 _target: str = _MATMUL_TRANSPOSED_ARGMAX_TARGET) -> jax.Array:
    """int32 [M]: `paged.sampler.first_argmax(matmul_transposed_cpu(x, w))` without the [M, N] logits (the first
    maximum, a NaN counting as +inf), in one pass over w: the greedy tied LM head. Operands as for
    `matmul_transposed_cpu`; rows from live_rows on are 0."""
    live = _check_transposed("matmul_transposed_argmax_cpu", x, w, live_rows, _target)
    if w.shape[0] < 1:
        raise ValueError(f"matmul_transposed_argmax_cpu needs at least one row of w; got {w.shape}")
    call = jax.ffi.ffi_call(_target, jax.ShapeDtypeStruct((x.shape[0],), jnp.int32))
    return call(x, w, live)


def transposed_matmul_native() -> bool:
    """Whether the default build runs the transposed calls (the tied LM head): AMX tiles or AVX-512 BF16."""
    return available()[0] and bool(_TRANSPOSED_NATIVE and _TRANSPOSED_NATIVE[0])


def _check_transposed(name: str, x: jax.Array, w: jax.Array, live_rows, target: str) -> jax.Array:
    """Refuses what the transposed calls cannot take; returns the live row count as an int32 array."""
    _require_kernels()
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1] or x.shape[1] % 32:
        raise ValueError(f"{name}: expected x [M, K] and w [N, K] with K a multiple of 32; got {x.shape} and "
                         f"{w.shape}")
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"{name} takes bfloat16 operands; got {x.dtype} and {w.dtype}")
    if target == name and not transposed_matmul_native():
        raise ValueError(f"{name} runs on AMX tiles or AVX-512 BF16, and this CPU (or OS) offers neither")
    return jnp.asarray(x.shape[0] if live_rows is None else live_rows).astype(jnp.int32)


# The AMX layout of a bfloat16 kernel [K, N] (amx.h: MatmulPacked): 64-column panels, each a run of 32-row
# steps of four 1 KB B tiles (16 row pairs x 16 columns x 2). Packed once at load, a decode step streams each
# thread's panels as one contiguous run instead of re-packing every weight it reads.
AMX_PANEL, AMX_STEP, AMX_PANEL_STEP_WORDS = 64, 32, 2048  # bfloat16; int8 tiles take twice the k a step


def _k_per_lane(dtype) -> int:
    """Consecutive k a B tile row holds per column: 4 for int8 (quads), else 2 (bfloat16 pairs)."""
    return 4 if jnp.dtype(dtype) == jnp.int8 else 2


def amx_packed_shape(in_features: int, out_features: int, dtype=jnp.bfloat16) -> tuple[int, int, int]:
    """The packed shape of a [K, N] kernel (N must be a multiple of 64): for bfloat16 tiles [N / 64, ceil(K / 32),
    2048], for int8 [N / 64, ceil(K / 64), 4096]."""
    if out_features % AMX_PANEL:
        raise ValueError(f"the AMX layout needs out_features a multiple of {AMX_PANEL}; got {out_features}")
    per_lane = _k_per_lane(dtype)
    return out_features // AMX_PANEL, -(-in_features // (16 * per_lane)), 1024 * per_lane


def pack_for_amx(w):
    """w [..., K, N] (numpy or jax; int8 codes, or a kernel for bfloat16 tiles) -> [..., N / 64, S, E] in the AMX
    layout (`amx_packed_shape`), rows past K zeros. With E the k a lane holds (2 for bfloat16, 4 for int8), element (p, s, t, i, c, e) of a
    panel step is w[16 E s + E i + e, 64 p + 16 t + c]: tile t of step s holds 16 rows of E k for 16 columns."""
    *lead, k, n = w.shape
    per_lane = _k_per_lane(w.dtype)
    panels, steps, step_size = amx_packed_shape(k, n, w.dtype)
    pad = [(0, 0)] * len(lead) + [(0, steps * 16 * per_lane - k), (0, 0)]
    w = (jnp.pad if isinstance(w, jax.Array) else np.pad)(w, pad)
    w = w.reshape(*lead, steps, 16, per_lane, panels, 4, 16)  # [s, i, e, p, t, c]
    d = len(lead)
    w = w.transpose(*range(d), d + 3, d, d + 4, d + 1, d + 5, d + 2)  # [p, s, t, i, c, e]
    return w.reshape(*lead, panels, steps, step_size)


def unpack_from_amx(packed, in_features: int):
    """The inverse of `pack_for_amx`: [..., N / 64, S, E] -> [..., K, N] (K = `in_features`)."""
    *lead, panels, steps, _ = packed.shape
    per_lane = _k_per_lane(packed.dtype)
    d = len(lead)
    w = packed.reshape(*lead, panels, steps, 4, 16, 16, per_lane)  # [p, s, t, i, c, e]
    w = w.transpose(*range(d), d + 1, d + 3, d + 5, d, d + 2, d + 4)  # [s, i, e, p, t, c]
    return w.reshape(*lead, steps * 16 * per_lane, panels * AMX_PANEL)[..., :in_features, :]


def matmul_packed_cpu(x: jax.Array, packed: jax.Array, live_rows: jax.Array | int | None = None) -> jax.Array:
    """x [M, K] @ w on AMX tiles, float32 [M, N], with w given packed (`pack_for_amx`: [N / 64, ceil(K / 32),
    2048]). bfloat16 operands; only where `matmul_on_amx()`. live_rows: as for `matmul_cpu`."""
    live = _check_packed("matmul_packed_cpu", x, packed, live_rows=live_rows)
    call = jax.ffi.ffi_call(_MATMUL_PACKED_TARGET,
                            jax.ShapeDtypeStruct((x.shape[0], packed.shape[0] * AMX_PANEL), jnp.float32))
    return call(x, packed, live)


def matmul_packed_rounded_cpu(x: jax.Array, packed: jax.Array, bias: jax.Array | None = None,
                              live_rows: jax.Array | int | None = None) -> jax.Array:
    """bfloat16 [M, N]: x [M, K] @ w (+ bias) on AMX tiles, rounded to bfloat16 once from the float32 sums, as
    `matmul_packed_cpu(x, packed) + bias` rounded would be, without the float32 product reaching memory (where
    the whole of K fits one block of the kernel's walk) or a separate pass to add and round. bias: bfloat16 [N]
    or None. Only where `matmul_on_amx()`. live_rows: as for `matmul_cpu`."""
    live = _check_packed("matmul_packed_rounded_cpu", x, packed, live_rows=live_rows)
    n = packed.shape[0] * AMX_PANEL
    if bias is None:
        bias = jnp.zeros((0,), jnp.bfloat16)
    elif bias.shape != (n,) or bias.dtype != jnp.bfloat16:
        raise ValueError(f"matmul_packed_rounded_cpu: expected a bfloat16 bias [{n}]; got {bias.dtype} {bias.shape}")
    call = jax.ffi.ffi_call(_MATMUL_PACKED_ROUNDED_TARGET,
                            (jax.ShapeDtypeStruct((x.shape[0], n), jnp.bfloat16),
                             jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)))
    return call(x, packed, bias, live)[0]


def _check_packed(name: str, x: jax.Array, *packed: jax.Array, live_rows) -> jax.Array:
    """Refuses what the packed AMX calls cannot take (x [M, K] bfloat16, each weight packed from [K, N] for
    one N, an AMX machine); returns the live row count as an int32 array."""
    _require_kernels()
    n = packed[0].shape[0] * AMX_PANEL
    if x.ndim != 2 or any(w.shape != amx_packed_shape(x.shape[1], n) for w in packed):
        raise ValueError(f"{name}: expected x [M, K] and packed weights [N / 64, ceil(K / 32), 2048] of one N; got "
                         f"{x.shape} and {[w.shape for w in packed]}")
    if x.dtype != jnp.bfloat16 or any(w.dtype != jnp.bfloat16 for w in packed):
        raise ValueError(f"{name} takes bfloat16 operands; got {x.dtype} and {[str(w.dtype) for w in packed]}")
    if not matmul_on_amx():
        raise ValueError(f"{name} runs on AMX tiles, and this CPU (or OS) offers none")
    return jnp.asarray(x.shape[0] if live_rows is None else live_rows).astype(jnp.int32)


def gated_matmul_packed_cpu(x: jax.Array, gate: jax.Array, up: jax.Array,
                            live_rows: jax.Array | int | None = None) -> jax.Array:
    """silu(x @ gate) * (x @ up) on AMX tiles, bfloat16 [M, N]: the gated MLP's first half in one call, its two
    float32 products kept in registers and cache. x: bfloat16 [M, K]; gate, up: packed (`pack_for_amx`) from
    [K, N]. Float32 sums and activation, rounded to bfloat16 once. Only where `matmul_on_amx()`. live_rows: as
    for `matmul_cpu`."""
    live = _check_packed("gated_matmul_packed_cpu", x, gate, up, live_rows=live_rows)
    call = jax.ffi.ffi_call(_GATED_MATMUL_PACKED_TARGET,
                            jax.ShapeDtypeStruct((x.shape[0], gate.shape[0] * AMX_PANEL), jnp.bfloat16))
    return call(x, gate, up, live)


def argmax_rows_cpu(x: jax.Array, *, _target: str = _ARGMAX_ROWS_TARGET) -> jax.Array:
    """int32 [S]: the first index of each row's maximum of float32 x [S, V], a NaN counting as +inf (as
    `paged.sampler.first_argmax`), in one vectorised pass per row on the intra-op threads."""
    _require_kernels()
    if x.ndim != 2 or x.dtype != jnp.float32 or x.shape[1] < 1:
        raise ValueError(f"argmax_rows_cpu takes float32 x [S, V] with V >= 1; got {x.dtype}{list(x.shape)}")
    return jax.ffi.ffi_call(_target, jax.ShapeDtypeStruct((x.shape[0],), jnp.int32))(x)


def add_rms_norm_cpu(h: jax.Array, delta: jax.Array, scale: jax.Array, eps: float, *,
                     _target: str = _ADD_RMS_NORM_TARGET) -> tuple[jax.Array, jax.Array]:
    """The residual add and RMSNorm between a decoder layer's blocks in one pass (norm.cc): bfloat16 h and delta
    [T, D], scale [D] -> (bf16(s), bf16(scale * bf16(s * rsqrt(mean(s^2) + eps)))) with s = h + delta in
    float32. The norm reads s before its rounding, as XLA's fusion of `paged.models.layers.RMSNorm` does."""
    _require_kernels()
    if h.ndim != 2 or h.shape != delta.shape or scale.shape != (h.shape[1],):
        raise ValueError(f"add_rms_norm_cpu: expected h and delta [T, D] and scale [D]; got {h.shape}, {delta.shape} "
                         f"and {scale.shape}")
    if any(a.dtype != jnp.bfloat16 for a in (h, delta, scale)):
        raise ValueError(f"add_rms_norm_cpu takes bfloat16 operands; got {h.dtype}, {delta.dtype}, {scale.dtype}")
    if not float(eps) >= 0:
        raise ValueError(f"add_rms_norm_cpu: eps must be a number >= 0; got {eps}")
    out = jax.ShapeDtypeStruct(h.shape, jnp.bfloat16)
    return tuple(jax.ffi.ffi_call(_target, (out, out))(h, delta, scale, eps=np.float32(eps)))


def quant_matmul_cpu(x: jax.Array, w: jax.Array, scales: jax.Array, live_rows: jax.Array | int | None = None, *,
                     zero_offsets: jax.Array | None = None, bias: jax.Array | None = None, out_dtype=jnp.float32,
                     _target: str = _QUANT_MATMUL_TARGET) -> jax.Array:
    """x [M, K] @ (codes * per-group scales - zero_offsets) + bias by the native kernel, in `out_dtype`.

    One call does the layer: the zero points' part is taken from each block's sums and the bias added in the
    kernel, and a bfloat16 result is rounded once from the float32 sums.

    x: float32 [M, K], or bfloat16 (then K and the rows per group even; codes meet x as exact bfloat16 pairs,
    `quant_matmul_takes_bfloat16`). w: int8 codes [K, N], or uint8 [K / 2, N] holding int4 codes + 8 (rows 2i
    and 2i + 1 in the low and high nibble). scales: [G, N], G dividing K, K / G a multiple or a divisor of 128
    (even for int4). zero_offsets: [G, N] (scale * (zero point - centre), models/quantization.py) or None.
    bias: [N] or None. The vectors are taken as float32 or bfloat16 (other dtypes are converted to float32).
    out_dtype: float32 or bfloat16. live_rows: as for `matmul_cpu`.
    """
    _require_kernels()
    rows = {jnp.dtype(jnp.int8): x.shape[1], jnp.dtype(jnp.uint8): x.shape[1] // 2}.get(jnp.dtype(w.dtype))
    if (x.ndim != 2 or w.ndim != 2 or scales.ndim != 2 or x.dtype not in (jnp.float32, jnp.bfloat16)
            or rows is None):
        raise ValueError(f"expected float32 or bfloat16 x [M, K], int8 or uint8 w, scales [G, N]; got "
                         f"{x.dtype}{list(x.shape)}, {w.dtype}{list(w.shape)}, {scales.dtype}{list(scales.shape)}")
    groups = scales.shape[0]
    if (w.shape[0] != rows or w.shape[1] % 64 or scales.shape[1] != w.shape[1] or x.shape[1] % groups
            or not _groups_fit(x.shape[1] // groups, w.dtype == jnp.uint8)):
        raise ValueError(f"quant_matmul_cpu: w {list(w.shape)} and scales {list(scales.shape)} do not fit x "
                         f"{list(x.shape)} (N a multiple of 64; rows per group a multiple or divisor of 128)")
    if x.dtype == jnp.bfloat16 and (x.shape[1] // groups) % 2:
        raise ValueError(f"quant_matmul_cpu: bfloat16 x needs an even number of rows per group; got x "
                         f"{list(x.shape)} and {groups} groups")
    if zero_offsets is not None and zero_offsets.shape != scales.shape:
        raise ValueError(f"quant_matmul_cpu: expected zero_offsets shaped as the scales {list(scales.shape)}; got "
                         f"{list(zero_offsets.shape)}")
    if bias is not None and bias.size != w.shape[1]:
        raise ValueError(f"quant_matmul_cpu: expected a bias of {w.shape[1]} values; got {list(bias.shape)}")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"quant_matmul_cpu: out_dtype must be float32 or bfloat16; got {out_dtype}")

    def vector(v, shape):  # as the kernel takes it: float32 or bfloat16 values, or [0] for none
        if v is None:
            return jnp.zeros((0,), jnp.float32)
        return v.reshape(shape) if v.dtype in (jnp.float32, jnp.bfloat16) else v.reshape(shape).astype(jnp.float32)

    live = jnp.asarray(x.shape[0] if live_rows is None else live_rows)
    y_shape = (x.shape[0], w.shape[1])
    sums = jax.ShapeDtypeStruct(y_shape if out_dtype == jnp.bfloat16 else (0,), jnp.float32)
    call = jax.ffi.ffi_call(_target, (jax.ShapeDtypeStruct(y_shape, out_dtype), sums))
    y, _ = call(x, w, vector(scales, scales.shape), vector(zero_offsets, scales.shape),
                vector(bias, (w.shape[1],)), live.astype(jnp.int32))
    return y


def _groups_fit(group_rows: int, int4: bool) -> bool:
    return (group_rows % 128 == 0 or 128 % group_rows == 0) and not (int4 and group_rows % 2)


def quant_matmul_takes(in_features: int, out_features: int, groups: int, bits: int) -> bool:
    """Whether `quant_matmul_cpu` takes a layer of this shape (and the build has its fast path)."""
    return (matmul_is_vectorized("int8") and out_features % 64 == 0 and in_features % groups == 0
            and _groups_fit(in_features // groups, bits == 4))


def int8_matmul_cpu(x: jax.Array, x_scale: jax.Array, w: jax.Array, w_scale: jax.Array,
                    live_rows: jax.Array | int | None = None, *, _target: str = _INT8_MATMUL_TARGET) -> jax.Array:
    """W8A8 as an integer product: (x @ w) * x_scale[m] * w_scale[n], float32 [M, N], the int8 codes multiplied
    with exact int32 sums (AVX-512 VNNI where the build has it, `int8_matmul_is_vectorized()`).

    x: int8 [M, K] activation codes, K a multiple of 4. x_scale: float32 [M] or [M, 1]. w: int8 [K, N] weight
    codes, N a multiple of 64. w_scale: float32 [N] or [1, N]. live_rows: as for `matmul_cpu`.
    """
    _require_kernels()
    if (x.ndim != 2 or w.ndim != 2 or x.dtype != jnp.int8 or w.dtype != jnp.int8 or x.shape[1] != w.shape[0]
            or x.shape[1] % 4 or w.shape[1] % 64):
        raise ValueError(f"int8_matmul_cpu: expected int8 x [M, K] and w [K, N] with K a multiple of 4 and N of "
                         f"64; got {x.dtype}{list(x.shape)} and {w.dtype}{list(w.shape)}")
    if x_scale.size != x.shape[0] or w_scale.size != w.shape[1]:
        raise ValueError(f"int8_matmul_cpu: expected x_scale [M] and w_scale [N]; got {list(x_scale.shape)} and "
                         f"{list(w_scale.shape)} for x {list(x.shape)}, w {list(w.shape)}")
    live = jnp.asarray(x.shape[0] if live_rows is None else live_rows)
    call = jax.ffi.ffi_call(_target, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32))
    return call(x, x_scale.reshape(-1).astype(jnp.float32), w, w_scale.reshape(-1).astype(jnp.float32),
                live.astype(jnp.int32))


def _check_w8a8_layer(name: str, x: jax.Array, w: jax.Array, w_scale: jax.Array,
                      zero_offsets: jax.Array | None) -> list[jax.Array]:
    """The layer's codes and vectors as the VNNI W8A8 calls take them (float32; offsets [0] for none)."""
    if (x.ndim != 2 or w.ndim != 2 or x.dtype not in (jnp.float32, jnp.bfloat16) or w.dtype != jnp.int8
            or x.shape[1] != w.shape[0] or x.shape[1] % 4 or w.shape[1] % 64):
        raise ValueError(f"{name}: expected float32 or bfloat16 x [M, K] and int8 w [K, N] with K a multiple of 4 "
                         f"and N of 64; got {x.dtype}{list(x.shape)} and {w.dtype}{list(w.shape)}")
    N = w.shape[1]
    if w_scale.size != N or (zero_offsets is not None and zero_offsets.size != N):
        raise ValueError(f"{name}: expected w_scale and zero_offsets of {N} values; got {list(w_scale.shape)} and "
                         f"{None if zero_offsets is None else list(zero_offsets.shape)}")
    offsets = jnp.zeros((0,), jnp.float32) if zero_offsets is None else zero_offsets.reshape(-1).astype(jnp.float32)
    return [w, w_scale.reshape(-1).astype(jnp.float32), offsets]


def w8a8_matmul_cpu(x: jax.Array, w: jax.Array, w_scale: jax.Array, zero_offsets: jax.Array | None = None,
                    live_rows: jax.Array | int | None = None, *, bias: jax.Array | None = None,
                    out_dtype=jnp.float32, _target: str = _W8A8_MATMUL_TARGET) -> jax.Array:
    """A W8A8 layer in one call on CPUs without AMX-INT8 (AVX-512 VNNI where the build has it,
    `int8_matmul_is_vectorized()`): x quantized per row in the call exactly as `activation_codes(x, "int8")`
    does, then `int8_matmul_cpu`'s integer product:
    y = (codes @ w) * x_scale[m] * w_scale[n] - (sum_k codes[m, k] * x_scale[m]) * zero_offsets[n] + bias[n],
    in float32, or in bfloat16 rounded once.

    x: float32 or bfloat16 [M, K], K a multiple of 4. w: int8 [K, N] as held, N a multiple of 64. w_scale:
    float32 [N] or [1, N]. zero_offsets, bias: [N] or [1, N], or None. live_rows: as for `matmul_cpu`.
    """
    _require_kernels()
    name = "w8a8_matmul_cpu"
    layer = _check_w8a8_layer(name, x, w, w_scale, zero_offsets)
    M, N = x.shape[0], w.shape[1]
    out_dtype = jnp.dtype(out_dtype)
    if (bias is not None and bias.size != N) or out_dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"{name}: expected a bias of {N} values and a float32 or bfloat16 result; got "
                         f"{None if bias is None else list(bias.shape)} and {out_dtype}")
    bias = jnp.zeros((0,), jnp.float32) if bias is None else bias.reshape(-1).astype(jnp.float32)
    live = jnp.asarray(M if live_rows is None else live_rows)
    sums = (M, N) if out_dtype == jnp.bfloat16 else (0,)  # a bfloat16 y's partial sums
    call = jax.ffi.ffi_call(_target, (jax.ShapeDtypeStruct((M, N), out_dtype), jax.ShapeDtypeStruct(sums, jnp.float32)))
    return call(x, *layer, bias, live.astype(jnp.int32))[0]


def w8a8_gated_matmul_cpu(x: jax.Array, gate: jax.Array, gate_scale: jax.Array, gate_offsets: jax.Array | None,
                          up: jax.Array, up_scale: jax.Array, up_offsets: jax.Array | None,
                          live_rows: jax.Array | int | None = None, out_dtype=None, *,
                          _target: str = _W8A8_GATED_MATMUL_TARGET) -> jax.Array:
    """silu(x @ gate) * (x @ up) for two W8A8 layers (each as `w8a8_matmul_cpu` computes it) in one call on CPUs
    without AMX-INT8: x quantized once for both, and the activation applied as the up projection's sums land,
    rounded once to `out_dtype` (float32 or bfloat16; default x's). gate, up: int8 codes [K, N] of one shape;
    their scales [N] and zero offsets [N] or None."""
    _require_kernels()
    name = "w8a8_gated_matmul_cpu"
    gate_args = _check_w8a8_layer(name, x, gate, gate_scale, gate_offsets)
    up_args = _check_w8a8_layer(name, x, up, up_scale, up_offsets)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if gate.shape != up.shape or out_dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"{name}: expected gate and up of one shape and a float32 or bfloat16 result; got "
                         f"{list(gate.shape)}, {list(up.shape)} and {out_dtype}")
    M, N = x.shape[0], gate.shape[1]
    live = jnp.asarray(M if live_rows is None else live_rows)
    call = jax.ffi.ffi_call(_target, (jax.ShapeDtypeStruct((M, N), out_dtype),
                                      jax.ShapeDtypeStruct((2, M, N), jnp.float32)))  # the partial sums
    return call(x, *gate_args, *up_args, live.astype(jnp.int32))[0]


def w8a8_matmul_packed_cpu(x: jax.Array, packed: jax.Array, w_scale: jax.Array, zero_offsets: jax.Array | None = None,
                           bias: jax.Array | None = None, live_rows: jax.Array | int | None = None,
                           out_dtype=None) -> jax.Array:
    """A W8A8 layer on AMX-INT8 tiles, x quantized per row in the call as `activation_codes(x, "int8")` does:
    y = (codes @ w) * x_scale[m] * w_scale[n] - (sum_k codes[m, k] * x_scale[m]) * zero_offsets[n] + bias[n],
    exact int32 sums, in `out_dtype` (default x's; a bfloat16 result is rounded once).

    x: float32 or bfloat16 [M, K]. packed: int8 weight codes [K, N] packed by `pack_for_amx` ([N / 64,
    ceil(K / 64), 4096]). w_scale: [N] or [1, N] (one scale per output column). zero_offsets, bias: [N] or
    [1, N], or None. Only where `w8a8_on_amx()`. live_rows: as for `matmul_cpu`.
    """
    vectors, live = _check_w8a8("w8a8_matmul_packed_cpu", x, live_rows, (packed, {"w_scale": w_scale,
                                "zero_offsets": zero_offsets, "bias": bias}))
    call = jax.ffi.ffi_call(_W8A8_PACKED_TARGET, jax.ShapeDtypeStruct((x.shape[0], packed.shape[0] * AMX_PANEL),
                                                                      jnp.dtype(out_dtype or x.dtype)))
    return call(x, packed, *vectors, live)


def w8a8_gated_matmul_packed_cpu(x: jax.Array, gate: jax.Array, gate_scale: jax.Array, gate_offsets: jax.Array | None,
                                 up: jax.Array, up_scale: jax.Array, up_offsets: jax.Array | None,
                                 live_rows: jax.Array | int | None = None, out_dtype=None, *,
                                 weight_only: bool = False) -> jax.Array:
    """silu(x @ gate) * (x @ up) for two W8A8 layers (each as `w8a8_matmul_packed_cpu` computes it, without
    bias) in one call: x quantized once, both products summed on the tiles and the activation applied before
    anything reaches memory, rounded once to `out_dtype` (default x's). gate, up: packed int8 codes of one
    [K, N]; their scales [N] and zero offsets [N] or None. weight_only: two weight-only int8 layers instead,
    as `int8_weights_matmul_packed_cpu` computes each (bfloat16 x as it is)."""
    name = "int8_weights_gated_matmul_packed_cpu" if weight_only else "w8a8_gated_matmul_packed_cpu"
    if weight_only and (x.dtype != jnp.bfloat16 or not int8_weights_on_amx()):
        raise ValueError(f"{name} takes bfloat16 x on a CPU with AMX; got {x.dtype}")
    vectors, live = _check_w8a8(name, x, live_rows, (gate, {"gate_scale": gate_scale, "gate_offsets": gate_offsets}),
                                (up, {"up_scale": up_scale, "up_offsets": up_offsets}))
    call = jax.ffi.ffi_call(_INT8_WEIGHTS_GATED_TARGET if weight_only else _W8A8_GATED_TARGET,
                            jax.ShapeDtypeStruct((x.shape[0], gate.shape[0] * AMX_PANEL), jnp.dtype(out_dtype or x.dtype)))
    return call(x, gate, *vectors[:2], up, *vectors[2:], live)


def int8_weights_matmul_packed_cpu(x: jax.Array, packed: jax.Array, w_scale: jax.Array,
                                   zero_offsets: jax.Array | None = None, bias: jax.Array | None = None,
                                   live_rows: jax.Array | int | None = None, out_dtype=None) -> jax.Array:
    """A weight-only int8 layer of a bfloat16 model on AMX tiles: y = (x @ codes) * w_scale[n] - (sum_k x[m, k]) *
    zero_offsets[n] + bias[n] in `out_dtype` (default bfloat16, rounded once). Up to 16 rows (decode) x is
    written as four int8 digits per element and multiplies the codes as they are on the int8 tiles, to float32
    accuracy; larger steps widen the codes to exact bfloat16 a panel at a time, float32 sums. x: bfloat16
    [M, K]; packed, w_scale, zero_offsets, bias as for `w8a8_matmul_packed_cpu` (one scale per output column).
    Only where `int8_weights_on_amx()`."""
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"int8_weights_matmul_packed_cpu takes bfloat16 x; got {x.dtype}")
    if not int8_weights_on_amx():
        raise ValueError("int8_weights_matmul_packed_cpu runs on AMX tiles, and this CPU (or OS) offers none")
    vectors, live = _check_w8a8("int8_weights_matmul_packed_cpu", x, live_rows, (packed, {
        "w_scale": w_scale, "zero_offsets": zero_offsets, "bias": bias}))
    call = jax.ffi.ffi_call(_INT8_WEIGHTS_TARGET, jax.ShapeDtypeStruct((x.shape[0], packed.shape[0] * AMX_PANEL),
                                                                       jnp.dtype(out_dtype or x.dtype)))
    return call(x, packed, *vectors, live)


def int8_weights_on_amx() -> bool:
    """Whether the default build runs weight-only int8 layers of bfloat16 models on AMX tiles
    (`int8_weights_matmul_packed_cpu`)."""
    return available()[0] and bool(_INT8_WEIGHTS_ON_AMX and _INT8_WEIGHTS_ON_AMX[0])


def amx_int4_packed_shape(in_features: int, out_features: int) -> tuple[int, int, int]:
    """The packed shape of int4 codes of a [K, N] kernel for the int8 tiles: [N / 64, ceil(K / 64), 2048]."""
    panels, steps, step_size = amx_packed_shape(in_features, out_features, jnp.int8)
    return panels, steps, step_size // 2


def pack_int4_for_amx(qweight):
    """int4 codes as the quantized layers hold them ([..., K / 2, N] uint8, row 2i in the low nibble and 2i + 1
    in the high: models/quantization.py) -> [..., N / 64, ceil(K / 64), 2048] uint8: the int8 codes' AMX
    layout (`pack_for_amx`) with each 4 KB step folded in two, byte j of a step holding code j in its low nibble
    and code j + 2048 in its high one; rows past K zeros. numpy or jax."""
    xp = jnp if isinstance(qweight, jax.Array) else np
    *lead, half, n = qweight.shape
    codes = xp.stack([qweight & 0xF, qweight >> 4], axis=-2).reshape(*lead, 2 * half, n).astype(xp.int8)
    steps = pack_for_amx(codes).astype(xp.uint8)
    return steps[..., :2048] | (steps[..., 2048:] << 4)


def unpack_int4_from_amx(packed, in_features: int):
    """The inverse of `pack_int4_for_amx`: [..., N / 64, S, 2048] -> [..., K / 2, N] uint8 (K = `in_features`)."""
    xp = jnp if isinstance(packed, jax.Array) else np
    steps = xp.concatenate([packed & 0xF, packed >> 4], axis=-1).astype(xp.int8)
    codes = unpack_from_amx(steps, in_features).astype(xp.uint8)
    return codes[..., 0::2, :] | (codes[..., 1::2, :] << 4)


def int4_matmul_packed_cpu(x: jax.Array, packed: jax.Array, scales: jax.Array, zero_offsets: jax.Array | None = None,
                           bias: jax.Array | None = None, live_rows: jax.Array | int | None = None,
                           out_dtype=None) -> jax.Array:
    """A weight-only int4 layer of a bfloat16 model on AMX-INT8 tiles: y = x @ ((u - 8) * scales[g] -
    zero_offsets[g]) + bias, u the codes (0..15) and g = k // (K / G) their group, in `out_dtype` (default
    bfloat16, rounded once). Up to 4 rows x is written as four int8 digits per element against the codes on the
    int8 tiles; 5 to 64 rows multiply the codes looked up as exact bfloat16 values (both float32 accuracy;
    amx_int4.cc); larger calls dequantize each panel once to bfloat16 (amx_widened.cc).

    x: bfloat16 [M, K]. packed: `pack_int4_for_amx` of the codes ([N / 64, ceil(K / 64), 2048] uint8). scales,
    zero_offsets: [G, N] (G = 1, or K / G a multiple of 64), zero_offsets or None. bias: [N] or None. Only where
    `int4_on_amx()`. live_rows: as for `matmul_cpu`."""
    vectors, live = _check_int4("int4_matmul_packed_cpu", x, live_rows, (packed, scales, zero_offsets))
    n = packed.shape[0] * AMX_PANEL
    if bias is not None and bias.size != n:
        raise ValueError(f"int4_matmul_packed_cpu: expected bias of {n} values; got {list(bias.shape)}")
    flat_bias = jnp.zeros((0,), jnp.float32) if bias is None else bias.reshape(-1).astype(jnp.float32)
    call = jax.ffi.ffi_call(_INT4_PACKED_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.dtype(out_dtype or x.dtype)))
    return call(x, packed, *vectors, flat_bias, live)


def int4_gated_matmul_packed_cpu(x: jax.Array, gate: jax.Array, gate_scales: jax.Array,
                                 gate_offsets: jax.Array | None, up: jax.Array, up_scales: jax.Array,
                                 up_offsets: jax.Array | None, live_rows: jax.Array | int | None = None,
                                 out_dtype=None) -> jax.Array:
    """silu(x @ gate) * (x @ up) for two weight-only int4 layers in the same groups (each as
    `int4_matmul_packed_cpu` computes it, without bias) in one call, rounded once to `out_dtype` (default x's)."""
    if gate_scales.shape != up_scales.shape:
        raise ValueError(f"int4_gated_matmul_packed_cpu: expected gate and up in the same groups; got scales "
                         f"{list(gate_scales.shape)} and {list(up_scales.shape)}")
    vectors, live = _check_int4("int4_gated_matmul_packed_cpu", x, live_rows, (gate, gate_scales, gate_offsets),
                                (up, up_scales, up_offsets))
    call = jax.ffi.ffi_call(_INT4_GATED_TARGET, jax.ShapeDtypeStruct((x.shape[0], gate.shape[0] * AMX_PANEL),
                                                                     jnp.dtype(out_dtype or x.dtype)))
    return call(x, gate, *vectors[:2], up, *vectors[2:], live)


def int4_on_amx() -> bool:
    """Whether the default build runs weight-only int4 layers of bfloat16 models on AMX-INT8 tiles
    (`int4_matmul_packed_cpu`; the same build and CPU as `int8_weights_on_amx`)."""
    return int8_weights_on_amx()


def _check_int4(name: str, x: jax.Array, live_rows, *weights: tuple[jax.Array, jax.Array, jax.Array | None]):
    """Refuses what the int4 AMX calls cannot take; returns each weight's scales and offsets as float32 ([G, N],
    offsets [0] for None) and the live row count as an int32 array."""
    _require_kernels()
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        raise ValueError(f"{name}: expected bfloat16 x [M, K]; got {x.dtype}{list(x.shape)}")
    k = x.shape[1]
    n = weights[0][0].shape[0] * AMX_PANEL if weights[0][0].ndim == 3 else 0
    flat = []
    for packed, scales, offsets in weights:
        if packed.dtype != jnp.uint8 or packed.shape != amx_int4_packed_shape(k, n):
            raise ValueError(f"{name}: expected uint8 codes packed [N / 64, ceil(K / 64), 2048] of one N for x "
                             f"{list(x.shape)}; got {packed.dtype}{list(packed.shape)}")
        groups = scales.shape[0] if scales.ndim == 2 else 0
        if scales.shape != (groups, n) or groups < 1 or (groups > 1 and (k % groups or k // groups % 64)):
            raise ValueError(f"{name}: expected scales [G, {n}] with G = 1 or K / G a multiple of 64 (K = {k}); "
                             f"got {list(scales.shape)}")
        if offsets is not None and offsets.shape != scales.shape:
            raise ValueError(f"{name}: expected zero_offsets shaped as the scales {list(scales.shape)}; got "
                             f"{list(offsets.shape)}")
        flat += [scales.astype(jnp.float32),
                 jnp.zeros((0,), jnp.float32) if offsets is None else offsets.astype(jnp.float32)]
    if not int4_on_amx():
        raise ValueError(f"{name} runs on AMX-INT8 tiles, and this CPU (or OS) offers none")
    return flat, jnp.asarray(x.shape[0] if live_rows is None else live_rows).astype(jnp.int32)


def _check_w8a8(name: str, x: jax.Array, live_rows, *weights: tuple[jax.Array, dict]):
    """Refuses what the W8A8 AMX calls cannot take; returns each weight's vectors as float32 [N] ([0] for
    None), in order, and the live row count as an int32 array."""
    _require_kernels()
    n = weights[0][0].shape[0] * AMX_PANEL if weights[0][0].ndim == 3 else 0
    if x.ndim != 2 or x.dtype not in (jnp.float32, jnp.bfloat16) or any(
            w.dtype != jnp.int8 or w.shape != amx_packed_shape(x.shape[1], n, jnp.int8) for w, _ in weights):
        raise ValueError(f"{name}: expected float32 or bfloat16 x [M, K] and int8 weights packed [N / 64, "
                         f"ceil(K / 64), 4096] of one N; got {x.dtype}{list(x.shape)} and "
                         f"{[f'{w.dtype}{list(w.shape)}' for w, _ in weights]}")
    flat = []
    for _, vectors in weights:
        for vector_name, v in vectors.items():
            if v is not None and v.size != n:
                raise ValueError(f"{name}: expected {vector_name} of {n} values; got {list(v.shape)}")
            flat.append(jnp.zeros((0,), jnp.float32) if v is None else v.reshape(-1).astype(jnp.float32))
    if not w8a8_on_amx():
        raise ValueError(f"{name} runs on AMX-INT8 tiles, and this CPU (or OS) offers none")
    return flat, jnp.asarray(x.shape[0] if live_rows is None else live_rows).astype(jnp.int32)


def w8a8_on_amx() -> bool:
    """Whether the default build runs W8A8 layers on AMX-INT8 tiles (`w8a8_matmul_packed_cpu`): the CPU has
    them, the compiler targets them and the OS granted this process the tile state."""
    return available()[0] and bool(_W8A8_ON_AMX and _W8A8_ON_AMX[0])


# The fewest rows for which W8A8's one call (`w8a8_matmul_cpu`) beats the layer's other CPU path (the weight-only
# quantized matmul on the activations quantized and back): `paged bench matmul` on the EPYC machine's 0.5B layer
# products, GFLOP/s of the call against the weight-only int8 product alone (which the other path pays for and
# then some): 8 rows 196 against 155, 16 rows 314 against 252, 64 rows 439 against 324; at 2 and 4 rows
# 66 and 131 against 70 and 150 (docs/kernels.md).
INT8_MATMUL_MIN_ROWS = 8


def int8_matmul_is_vectorized() -> bool:
    """Whether the default build multiplies `int8_matmul_cpu`'s codes with AVX-512 VNNI (else the W8A8 layers
    keep their float path on this CPU)."""
    return available()[0] and _VECTORIZED_MATMUL.get("w8a8", False)


def quant_matmul_takes_bfloat16(in_features: int, groups: int) -> bool:
    """Whether a layer `quant_matmul_takes` can also take bfloat16 x as it is (the build has the AVX-512 BF16
    path, and k pairs fit its groups); otherwise the caller widens x to float32."""
    return available()[0] and _VECTORIZED_MATMUL.get("int8_bfloat16", False) and (in_features // groups) % 2 == 0


def matmul_target_without_amx() -> str:
    """The FFI target of the matmul built without AMX (`-mno-amx-*`), for `matmul_cpu(..., _target=...)`: the
    AVX-512 BF16 path that an AMX machine otherwise never runs (its tests, `paged bench matmul`). Raises
    RuntimeError when that build fails."""
    target = "paged_attention_cpu_no_amx"
    reason = _load(_FLAGS + ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"), target)
    if reason is not None:
        raise RuntimeError(f"the kernels without AMX did not build: {reason}")
    return _MATMUL_TARGET + target[len(_TARGET):]


def matmul_max_rows(dtype) -> int:
    """The most rows for which `matmul_cpu` in `dtype` is faster than XLA's dot on this machine (0: never)."""
    name = jnp.dtype(dtype).name
    if not matmul_is_vectorized(name) or name not in MATMUL_MAX_ROWS:
        return 0
    return 2**31 - 1 if name == "bfloat16" and matmul_on_amx() else MATMUL_MAX_ROWS[name]


def matmul_on_amx() -> bool:
    """Whether the default build runs bfloat16 products on AMX tiles: the CPU has AMX-BF16, the compiler
    targets it, and the OS granted this process the tile state."""
    return available()[0] and bool(_MATMUL_ON_AMX and _MATMUL_ON_AMX[0])


def prompt_attention_on_amx() -> bool:
    """Whether the default build runs bfloat16 prompt chunks (pages of 16, head_dim a multiple of 32 up to 256,
    no soft cap) on AMX tiles (amx_attention.cc); elsewhere they take the float32 FMA tiles."""
    return available()[0] and bool(_PROMPTS_ON_AMX and _PROMPTS_ON_AMX[0])


def matmul_is_vectorized(dtype="float32") -> bool:
    """Whether the default build has the matmul's fast path for `dtype` (AVX-512 for float32, AVX-512 BF16 for
    bfloat16); without it XLA's dot is faster, and callers keep XLA."""
    return available()[0] and _VECTORIZED_MATMUL.get(jnp.dtype(dtype).name, False)
