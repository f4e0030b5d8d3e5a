"""The greedy tied LM head through an int8 screen of its table (amx_screen.cc).

A plain-greedy decode step on the native path reads the whole bfloat16 embedding table to find each row's first
maximum (`matmul_transposed_argmax_cpu`). `greedy_screen` builds, once per table, an int8 copy with the per-row
norms that bound its error; `screened_argmax_cpu` then reads the copy (half the bytes), keeps the rows whose
upper bound reaches the best lower bound, and sums only those exactly with the full walk's own tile steps. Its
tokens are `matmul_transposed_argmax_cpu`'s, always: where the bounds cannot decide, it reads the whole table.

The bounds are rounded up here in float64, so that the kernel's float32 arithmetic only ever adds slack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged.kernels import cpu

# Rows converted to float64 at a time (8 MB a chunk at K = 896): the table itself may be hundreds of MB.
_CHUNK_ROWS = 1024


def screen_native() -> bool:
    """Whether the default build runs the screened head (AMX-INT8 tiles, and the OS lets this process use them)."""
    return cpu.available()[0] and bool(cpu._SCREEN_NATIVE and cpu._SCREEN_NATIVE[0])


def _up(values: np.ndarray) -> np.ndarray:
    """float32 values not below float64 `values` (>= 0): a relative 2^-20 over covers float32's rounding."""
    return (values * (1.0 + 2.0**-20)).astype(np.float32)


def greedy_screen(table) -> dict | None:
    """The int8 screen of a table [N, K] (bfloat16, K a multiple of 32), as host arrays: {"codes": int8
    [ceil(N / 32) * 32 * ceil(K / 64) * 64] in the kernel's tile order, "stats": float32 [3, ceil(N / 32) * 32],
    "limits": float32 [2]}; None when the table is not finite (the kernel's bounds would not hold).

    Row n's codes are round(w_n / sigma_n) with sigma_n = float32(max|w_n| / 127); stats are sigma_n, ||w^_n||
    and ||w_n - w^_n|| + gamma_K ||w_n|| (w^_n = codes * sigma_n, gamma_K = K u / (1 - K u) with u = 2^-24:
    what K float32 additions of exact products can lose); limits the largest ||w_n|| and the largest |w|."""
    table = np.asarray(table)
    if table.ndim != 2 or table.shape[1] % 32 or table.dtype != jnp.bfloat16:
        raise ValueError(f"greedy_screen takes a bfloat16 table [N, K] with K a multiple of 32; got {table.dtype}"
                         f"{list(table.shape)}")
    rows, depth = table.shape
    padded_rows, padded_depth = -(-rows // 32) * 32, -(-depth // 64) * 64
    unit = 2.0**-24
    gamma = depth * unit / (1 - depth * unit)
    codes = np.zeros((padded_rows, padded_depth), np.int8)
    stats = np.zeros((3, padded_rows), np.float32)
    norm_max = peak_max = 0.0
    for start in range(0, rows, _CHUNK_ROWS):
        w = table[start:start + _CHUNK_ROWS].astype(np.float64)
        if not np.isfinite(w).all():
            return None
        peak = np.abs(w).max(axis=1)
        sigma = (peak / 127).astype(np.float32)
        wide_sigma = sigma.astype(np.float64)[:, None]
        code = np.clip(np.rint(np.divide(w, wide_sigma, out=np.zeros_like(w), where=wide_sigma > 0)), -127, 127)
        approx = code * wide_sigma
        norm = np.linalg.norm(w, axis=1)
        end = start + w.shape[0]
        codes[start:end, :depth] = code
        stats[0, start:end] = sigma
        stats[1, start:end] = _up(np.linalg.norm(approx, axis=1))
        stats[2, start:end] = _up(np.linalg.norm(w - approx, axis=1) + gamma * norm)
        norm_max, peak_max = max(norm_max, float(norm.max())), max(peak_max, float(peak.max()))
    # (b, h, j, s, q, e) -> (b, s, h, q, j, e): byte (b, s, h, q, j, e) codes[32 b + 16 h + j, 64 s + 4 q + e].
    tiles = codes.reshape(padded_rows // 32, 2, 16, padded_depth // 64, 16, 4).transpose(0, 3, 1, 4, 2, 5)
    limits = np.array([_up(np.float64(norm_max)), np.float32(peak_max)], np.float32)
    return {"codes": np.ascontiguousarray(tiles).reshape(-1), "stats": stats, "limits": limits}


def screened_argmax_cpu(x: jax.Array, w: jax.Array, screen: dict, live_rows: jax.Array | int | None = None, *,
                        _target: str = cpu._SCREENED_ARGMAX_TARGET) -> jax.Array:
    """int32 [M]: `matmul_transposed_argmax_cpu(x, w, live_rows)` read through `screen` (`greedy_screen(w)`'s
    arrays, built from this very table: a screen of other weights gives wrong tokens)."""
    live = cpu._check_transposed("screened_argmax_cpu", x, w, live_rows, _target)
    if _target == cpu._SCREENED_ARGMAX_TARGET and not screen_native():
        raise ValueError("screened_argmax_cpu runs on AMX-INT8 tiles, and this CPU (or OS) offers none")
    call = jax.ffi.ffi_call(_target, jax.ShapeDtypeStruct((x.shape[0],), jnp.int32))
    return call(x, w, screen["codes"], screen["stats"], screen["limits"], live)
