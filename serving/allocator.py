"""tcmalloc under the `paged` command on CPU hosts.

Why: XLA's CPU runtime allocates each step's buffers from the C library's allocator, and glibc hands
allocations past its mmap threshold (at most 32 MB) fresh pages every time: a prompt step of the 0.5B shape
(logits [64, 151,936] in float32 alone are 39 MB) faulted in hundreds of megabytes per step. tcmalloc keeps and
reuses them. Measured side by side (`paged bench throughput --model-shape qwen2.5-0.5b`, docs/performance.md):
151.9 output tok/s with glibc against 169.1 with tcmalloc. vLLM's CPU backend asks for the same preload.

The dynamic loader reads LD_PRELOAD only at start-up, so `paged` re-executes itself once with the library
preloaded when it is installed (Debian/Ubuntu: `apt-get install libtcmalloc-minimal4`). PAGED_TCMALLOC=0 turns
this off; an LD_PRELOAD that already names tcmalloc is kept as it is. Python code that imports paged
directly (notebooks, `LLM(...)`) is not re-executed: preload tcmalloc in its environment to get the same.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                "/usr/local/lib")
_PRELOADED = "PAGED_TCMALLOC_PRELOADED"  # set in the re-executed process: never re-execute twice


def find_tcmalloc(dirs: tuple[str, ...] = LIBRARY_DIRS) -> str | None:
    """The path of an installed tcmalloc shared library, or None."""
    for directory in dirs:
        for name in LIBRARIES:
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                return path
    return None


def preload_env(environ: Mapping[str, str], library: str | None) -> dict[str, str] | None:
    """The environment to re-execute with (`library` first in LD_PRELOAD), or None when not to: not Linux,
    no library, opted out (PAGED_TCMALLOC=0), already preloaded or re-executed, or JAX told to run on
    something other than the CPU (JAX_PLATFORMS without "cpu")."""
    platforms = environ.get("JAX_PLATFORMS", "")
    if (sys.platform != "linux" or library is None or environ.get("PAGED_TCMALLOC", "1") == "0"
            or _PRELOADED in environ or "tcmalloc" in environ.get("LD_PRELOAD", "")
            or (platforms and "cpu" not in platforms.split(","))):
        return None
    preload = ":".join(p for p in (library, environ.get("LD_PRELOAD", "")) if p)
    return {**environ, "LD_PRELOAD": preload, _PRELOADED: library}


def preload_tcmalloc() -> None:
    """Re-executes this process with tcmalloc preloaded where `preload_env` says to; returns otherwise."""
    env = preload_env(os.environ, find_tcmalloc())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
