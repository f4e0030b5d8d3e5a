"""serving/allocator.py: when `paged` re-executes itself with tcmalloc preloaded, and that the preload takes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from paged.serving.allocator import find_tcmalloc, preload_env

LIB = "/usr/lib/libtcmalloc_minimal.so.4"


@pytest.mark.parametrize("environ, preloads", [
    ({}, True),
    ({"JAX_PLATFORMS": "cpu"}, True),
    ({"JAX_PLATFORMS": "cuda,cpu"}, True),
    ({"JAX_PLATFORMS": "cuda"}, False),         # not a CPU run
    ({"PAGED_TCMALLOC": "0"}, False),           # opted out
    ({"LD_PRELOAD": "/opt/libtcmalloc.so"}, False),  # the user's own tcmalloc stays
    ({"PAGED_TCMALLOC_PRELOADED": LIB}, False),  # already re-executed once
])
def test_preload_env_decides(environ, preloads):
    env = preload_env(environ, LIB)
    assert (env is not None) == preloads
    if preloads:
        assert env["LD_PRELOAD"] == LIB and env["PAGED_TCMALLOC_PRELOADED"] == LIB
        assert {k: env[k] for k in environ} == environ


def test_preload_env_keeps_other_preloads_and_needs_a_library():
    env = preload_env({"LD_PRELOAD": "/opt/libiomp5.so"}, LIB)
    assert env["LD_PRELOAD"] == f"{LIB}:/opt/libiomp5.so"
    assert preload_env({}, None) is None


def test_find_tcmalloc_looks_in_the_library_dirs(tmp_path):
    assert find_tcmalloc((str(tmp_path),)) is None
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    assert find_tcmalloc((str(tmp_path),)) == str(tmp_path / "libtcmalloc.so.4")


_REPORT = ("from paged.serving.allocator import preload_tcmalloc; preload_tcmalloc(); "
           "print('tcmalloc' in open('/proc/self/maps').read())")


@pytest.mark.parametrize("opt_out", [False, True])
def test_the_process_runs_on_with_tcmalloc_mapped(opt_out):
    """The re-executed process has the library mapped (and runs the same code to its end); opted out, it
    does not. CI installs libtcmalloc-minimal4 (.ci/run)."""
    if sys.platform != "linux" or find_tcmalloc() is None:
        pytest.skip("no tcmalloc installed here (apt-get install libtcmalloc-minimal4)")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PAGED_TCMALLOC_PRELOADED")}
    env.update(JAX_PLATFORMS="cpu", PAGED_TCMALLOC="0" if opt_out else "1")
    out = subprocess.run([sys.executable, "-c", _REPORT], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(not opt_out)
