"""The notebooks run through a real Jupyter kernel (nbclient), as stored: same cells, same kinds of output,
no errors, within the stated time budget; and what is stored carries no machine paths or times of day."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebook tests need nbformat and nbclient (requirements/)")
pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "notebooks"))
import execute  # noqa: E402  (notebooks/execute.py)

NOTEBOOKS = execute.notebooks()
_elapsed: dict[str, float] = {}


def _shape(notebook) -> list:
    """Per cell: its type and, for code, the kinds of output it made (stream name, or output type plus the
    image/text kinds of rich outputs)."""
    shape = []
    for cell in notebook.cells:
        kinds = []
        for output in cell.get("outputs", []):
            if output["output_type"] == "stream":
                kinds.append(("stream", output["name"]))
            else:
                kinds.append((output["output_type"], tuple(sorted(k for k in output.get("data", {})
                                                                   if k.startswith("image/")))))
        shape.append((cell["cell_type"], tuple(sorted(set(kinds)))))
    return shape


def test_there_are_notebooks():
    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "kernel_lab", "continuous_batching", "paged_kv_cache", "sampling"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_as_stored(path):
    stored = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    fresh = execute.execute(path)
    _elapsed[path.stem] = time.perf_counter() - start
    errors = [o for c in fresh.cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors, f"{path.name}: {errors[0]['ename']}: {errors[0]['evalue']}"
    assert _shape(fresh) == _shape(stored), f"{path.name}: outputs differ in structure from the stored ones " \
                                            "(re-run `python notebooks/execute.py` and commit)"
    assert all(c.get("execution_count") for c in stored.cells if c["cell_type"] == "code"), \
        f"{path.name}: stored without being run"


def test_the_notebooks_fit_their_time_budget():
    if len(_elapsed) < len(NOTEBOOKS):
        pytest.skip("runs after every notebook has run in this session")
    assert sum(_elapsed.values()) < execute.TIME_BUDGET_S, _elapsed


_MACHINE = re.compile(r"/root/|/home/\w|/tmp/|/work/|\b\d\d:\d\d:\d\d\b")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_outputs_hold_no_machine_paths_or_times(path):
    for cell in nbformat.read(path, as_version=4).cells:
        assert "execution" not in cell.get("metadata", {}), f"{path.name}: nbclient's timestamps were stored"
        for output in cell.get("outputs", []):
            text = output.get("text", "") + output.get("data", {}).get("text/plain", "")
            assert not _MACHINE.search(text), f"{path.name}: {_MACHINE.search(text).group()!r} in {text[:200]!r}"
