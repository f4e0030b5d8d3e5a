"""The one cache root: `$PAGED_CACHE_DIR`, default `~/.cache/paged`.

Everything the project keeps between runs lives under it: the native kernels' builds (`kernels/`), the XLA
compilation cache (`xla/`), the built-in tiny model (`paged-tiny-llama/`) and the benchmarks' models
(`benchmarks/`). It is defined here, in the package every other one may import, so one variable moves all
of them.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_VARIABLE = "PAGED_CACHE_DIR"


def cache_root() -> Path:
    """`$PAGED_CACHE_DIR` (a leading `~` expanded), else `~/.cache/paged`; read on every call."""
    value = os.environ.get(CACHE_DIR_VARIABLE, "").strip()
    return Path(value).expanduser() if value else Path.home() / ".cache" / "paged"
