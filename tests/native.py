"""The mark for tests that need the native CPU kernels built.

They need a C++ compiler: where none is installed they skip and say so (the engine itself falls back to the
XLA path there, which tests/pallas_kernels/test_platform.py checks). With a compiler, a build that fails makes
them fail: a broken kernel never hides behind a skip.
"""

import pytest

from paged.kernels import cpu

needs_compiler = pytest.mark.skipif(
    cpu.compiler() is None, reason="no C++ compiler on PATH (g++ or $CXX): the native CPU kernels cannot be built here")


def cache_root_sharing_kernels(path):
    """`path` made a cache root ($PAGED_CACHE_DIR) whose kernels/ is this one's: a test that moves the cache for
    its XLA cache or benchmark models does not rebuild the native kernels (30-40 s on a 2-core machine). The
    builds are keyed by a hash of their sources and flags, so sharing them changes nothing else."""
    from pathlib import Path

    from paged.kernels.cache import cache_root
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cpu.available()  # built here first (where a compiler is), so there is a build to share
    kernels = cache_root() / "kernels"
    if kernels.is_dir() and not (path / "kernels").exists():
        (path / "kernels").symlink_to(kernels, target_is_directory=True)
    return path
