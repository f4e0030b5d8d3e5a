"""Native CPU kernels as XLA FFI calls: paged attention (`paged_attention.cc`) and a decode-sized float32
matmul (`matmul.cc`), beside this file.

XLA's CPU code cannot read pages in place: the chunked path (`xla.py`) gathers every chunk of pages into a
temporary before its matmuls, and that copy plus the loop's per-op cost was 43% of the engine's device time
on the benchmark workload. This kernel walks each (token, KV head)'s pages straight from the pool, only the
keys the token can see, with the online softmax in registers, spread over XLA's intra-op threads.

The source is compiled on first use with the machine's C++ compiler (`CXX`, default `g++`) for the host
CPU (`-march=native`) and cached under `$PAGED_CACHE_DIR/kernels` (pallas_kernels/cache.py) by a hash of
the source, the compiler, the flags and jaxlib's version; `available()` says whether that worked, and why not.
"""

from __future__ import annotations

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

from pallas_kernels.cache import cache_root

_SOURCE_DIR = Path(__file__).parent
_SOURCES = (_SOURCE_DIR / "paged_attention.cc", _SOURCE_DIR / "matmul.cc")
_HEADERS = (_SOURCE_DIR / "parallel.h",)
_TARGET = "paged_attention_cpu"
_MATMUL_TARGET = "matmul_cpu"
_VECTORIZED_MATMUL: list[bool] = []  # filled by _load(): whether the default build has the AVX-512 matmul
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


def _build(flags: tuple[str, ...] = _FLAGS) -> Path:
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler: {compiler!r} is not on PATH (set CXX)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    # The FFI headers come with jaxlib, and -march=native ties the code to this CPU: a library is reused only
    # with the same jaxlib on the same kind of CPU (a cache directory may be shared between machines).
    sources = [path.read_text() for path in (*_SOURCES, *_HEADERS)]
    key = hashlib.sha256("\0".join([*sources, compiler, version, " ".join(flags),
                                    importlib.metadata.version("jaxlib"), _host_cpu()]).encode()).hexdigest()[:16]
    library = _cache_dir() / f"paged_attention_cpu_{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        out = Path(tmp) / library.name
        cmd = [compiler, *flags, f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES), "-o", str(out)]
        result = subprocess.run(cmd, capture_output=True, text=True)
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
        if target == _TARGET:
            _VECTORIZED_MATMUL.append(bool(library.MatmulCpuIsVectorized()))
    except Exception as error:  # noqa: BLE001 - any failure means "use the XLA path", reported by available()
        return f"{type(error).__name__}: {error}"
    return None


def available() -> tuple[bool, str]:
    """(True, "") when the native kernel is built and registered, else (False, the reason)."""
    reason = _load()
    return reason is None, reason or ""


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
    ok, reason = available()
    if not ok:
        raise RuntimeError(f"the native CPU attention kernel is unavailable: {reason}")
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


# Rows up to which `matmul_cpu` beats XLA's dot (decode steps, small mixed steps); larger products stay on
# XLA, which reaches ~90% of its large-matmul rate there. GFLOP/s on a decode step's own products (8 layers'
# projections, 96 MB of weights) against XLA: 8 rows 135-163 vs 103-115, 48: 425-445 vs 305-320,
# 128: 439 vs 374, 192: 418 vs 395, 256: 408 vs 433, 512: 409 vs 436.
MATMUL_MAX_ROWS = 192


def matmul_cpu(x: jax.Array, w: jax.Array, live_rows: jax.Array | int | None = None, *,
               _target: str = _MATMUL_TARGET) -> jax.Array:
    """x [M, K] @ w [K, N] in float32 by the native kernel; N must be a multiple of 64.

    live_rows: int32 scalar (may be traced); only rows [0, live_rows) are computed and the rest of the result
      is zeros (rows past a step's real tokens are padding). None: all M.
    """
    ok, reason = available()
    if not ok:
        raise RuntimeError(f"the native CPU kernels are unavailable: {reason}")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or w.shape[1] % 64:
        raise ValueError(f"expected x [M, K] and w [K, N] with N a multiple of 64; got {x.shape} and {w.shape}")
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"matmul_cpu takes float32; got {x.dtype} and {w.dtype}")
    live = jnp.asarray(x.shape[0] if live_rows is None else live_rows)
    if live.shape != () or not jnp.issubdtype(live.dtype, jnp.integer):
        raise ValueError(f"live_rows must be an integer scalar; got {live.dtype}{list(live.shape)}")
    call = jax.ffi.ffi_call(_target, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32))
    return call(x, w, live.astype(jnp.int32))


def matmul_is_vectorized() -> bool:
    """Whether the default build has the AVX-512 matmul (without it XLA's dot is faster: callers keep XLA)."""
    return available()[0] and _VECTORIZED_MATMUL[0]
