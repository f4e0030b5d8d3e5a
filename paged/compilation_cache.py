"""The persistent XLA compilation cache: a restarted engine loads the steps it compiled before.

A CPU engine spends most of its warm-up compiling its step shapes (the benchmark model: ~13 s for 7 shapes).
JAX can keep compiled executables on disk, keyed by the program, the compile options and the jax/jaxlib
versions, so the same engine started again skips XLA's compile (its tracing and lowering still run): the
benchmark model's start plus first generate went from 12.9 s to 7.0 s on the second run. The cache is a
process-wide JAX setting, so `configure` only sets it when asked and keeps one the user already made.
"""

from __future__ import annotations

from pathlib import Path

import jax
from jax.experimental.compilation_cache.compilation_cache import reset_cache

from paged.kernels.cache import cache_root


def default_dir() -> Path:
    """`$PAGED_CACHE_DIR/xla` (default `~/.cache/paged/xla`), beside the native kernels' builds."""
    return cache_root() / "xla"


def configure(setting: str | None) -> str | None:
    """Applies `EngineConfig.compilation_cache_dir`; returns the directory JAX caches in (None: no cache).

    "auto": JAX's own setting when the user made one, else `default_dir()`. A path: that directory. None:
    JAX's settings are left as they are. Where this sets the directory it also caches every compile,
    however short: JAX's default (only compiles over 1 s) kept none of the benchmark engine's steps, which
    take under a second each to compile here.
    """
    current = jax.config.jax_compilation_cache_dir or None
    if setting is None or (setting == "auto" and current):
        return current
    path = str(default_dir() if setting == "auto" else Path(setting).expanduser())
    if path != current:
        jax.config.update("jax_compilation_cache_dir", path)
        # JAX opens its cache once, at the first compile with a directory set; a later directory needs a reset.
        reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path
