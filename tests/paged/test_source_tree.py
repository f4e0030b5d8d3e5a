"""paged/_source_tree.py: a checkout that was never installed imports paged.models, paged.serving,
paged.kernels and paged.benchmarks from the folders pyproject.toml's package-dir names."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_checkout_never_installed_imports_every_subpackage_from_its_folder():
    # The editable install's own finder is taken away first: only the checkout's finder is left to find them.
    script = textwrap.dedent(f"""
        import sys
        sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
        sys.path.insert(0, {str(REPO)!r})
        import paged.benchmarks.common, paged.kernels.cpu, paged.models.linear, paged.serving.protocol
        for module in (paged.benchmarks.common, paged.kernels.cpu, paged.models.linear, paged.serving.protocol):
            print(module.__file__)
        print(sorted(m for m in ("models", "serving", "pallas_kernels", "benchmarks") if m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd="/", env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    *files, top_level = done.stdout.split("\n")[:5]
    assert files == [str(REPO / "benchmarks" / "common.py"), str(REPO / "pallas_kernels" / "cpu" / "__init__.py"),
                     str(REPO / "models" / "linear.py"), str(REPO / "serving" / "protocol.py")]
    assert top_level == "[]"  # nothing of ours under a top-level name
