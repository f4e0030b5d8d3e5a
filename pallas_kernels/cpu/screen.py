"""The greedy tied LM head through an int8 screen of its table (head_screen.cc).

A plain-greedy decode step on the native path reads the whole bfloat16 embedding table to find each row's first
maximum (`matmul_transposed_argmax_cpu`). `greedy_screen` builds, once per table, an int8 copy with the per-row
norms that bound its error; `screened_argmax_cpu` then reads the copy (half the bytes), keeps the rows whose
upper bound reaches the best lower bound, and sums only those exactly with the full walk's own arithmetic. Its
tokens are `matmul_transposed_argmax_cpu`'s, always: where the bounds cannot decide, it reads the whole table.
The screen's products run on AMX-INT8 tiles, or on CPUs without them on AVX-512 VNNI (the same codes, in the
same layout).

The bounds are summed in float64 and rounded up when the screen is built, so that the kernel's float32 arithmetic
only ever adds slack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged.kernels import cpu


def screen_native(_build: str = cpu._TARGET) -> bool:
    """Whether the default build (or `_build`, one `cpu._load` made) runs the screened head: on AMX-INT8 tiles
    the OS lets this process use, or on AVX-512 VNNI and BF16."""
    return cpu.available()[0] and cpu._SCREEN_NATIVE.get(_build, False)


def greedy_screen(table) -> dict | None:
    """The int8 screen of a table [N, K] (bfloat16, K a multiple of 32), built natively in one pass over the table
    (head_screen.cc: BuildScreen; 0.3 s for the 0.5B table on two cores, where numpy took 1.6): {"codes": int8
    [ceil(N / 32) * 32 * ceil(K / 64) * 64] in the kernel's tile order, "stats": float32 [3, ceil(N / 32) * 32],
    "limits": float32 [2]}; None when the table is not finite (the kernel's bounds would not hold).

    Row n's codes are round(w_n / sigma_n) with sigma_n = float32(max|w_n| / 127); stats are sigma_n, ||w^_n||
    and ||w_n - w^_n|| + gamma_K ||w_n|| (w^_n = codes * sigma_n, gamma_K = K u / (1 - K u) with u = 2^-24:
    what K float32 additions of exact products can lose), summed in float64 and rounded up; limits the largest
    ||w_n|| (rounded up) and the largest |w|."""
    if table.ndim != 2 or table.shape[0] < 1 or table.shape[1] % 32 or table.dtype != jnp.bfloat16:
        raise ValueError(f"greedy_screen takes a bfloat16 table [N, K] with N >= 1 and K a multiple of 32; got "
                         f"{table.dtype}{list(table.shape)}")
    cpu._require_kernels()
    rows, depth = table.shape
    padded_rows, padded_depth = -(-rows // 32) * 32, -(-depth // 64) * 64
    call = jax.ffi.ffi_call(cpu._BUILD_SCREEN_TARGET, (
        jax.ShapeDtypeStruct((padded_rows * padded_depth,), jnp.int8),
        jax.ShapeDtypeStruct((3, padded_rows), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.float32)))
    codes, stats, limits = call(jnp.asarray(table))
    if not np.isfinite(np.asarray(limits)).all():
        return None
    return {"codes": codes, "stats": stats, "limits": limits}


def screened_argmax_cpu(x: jax.Array, w: jax.Array, screen: dict, live_rows: jax.Array | int | None = None, *,
                        _target: str = cpu._SCREENED_ARGMAX_TARGET) -> jax.Array:
    """int32 [M]: `matmul_transposed_argmax_cpu(x, w, live_rows)` read through `screen` (`greedy_screen(w)`'s
    arrays, built from this very table: a screen of other weights gives wrong tokens)."""
    live = cpu._check_transposed("screened_argmax_cpu", x, w, live_rows, _target)
    if _target == cpu._SCREENED_ARGMAX_TARGET and not screen_native():
        raise ValueError("screened_argmax_cpu runs on AMX-INT8 tiles or AVX-512 VNNI and BF16, and this CPU (or OS) "
                         "offers neither")
    call = jax.ffi.ffi_call(_target, jax.ShapeDtypeStruct((x.shape[0],), jnp.int32))
    return call(x, w, screen["codes"], screen["stats"], screen["limits"], live)
