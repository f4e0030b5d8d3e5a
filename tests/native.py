"""The mark for tests that need the native CPU kernels built.

They need a C++ compiler: where none is installed they skip and say so (the engine itself falls back to the
XLA path there, which tests/pallas_kernels/test_platform.py checks). With a compiler, a build that fails makes
them fail: a broken kernel never hides behind a skip.
"""

import pytest

from paged.kernels import cpu

needs_compiler = pytest.mark.skipif(
    cpu.compiler() is None, reason="no C++ compiler on PATH (g++ or $CXX): the native CPU kernels cannot be built here")
