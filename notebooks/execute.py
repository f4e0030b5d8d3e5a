"""Runs the notebooks through a real Jupyter kernel (nbclient) and stores them with their outputs.

    python notebooks/execute.py                 # every notebook, outputs written back
    python notebooks/execute.py kernel_lab      # one

Stored outputs carry no machine paths or times of day: the home directory becomes `~`, this checkout `.`,
temporary directories `<tmp>`, and log timestamps are dropped, so a re-run changes only what the run
measured. tests/test_notebooks.py executes them again and compares the structure with what is stored.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# What the whole set may take on a 2-core CPU (tests/test_notebooks.py holds CI to it).
TIME_BUDGET_S = 420

_LOG_TIME = re.compile(r"\b\d\d-\d\d \d\d:\d\d:\d\d\b")


def notebooks() -> list[Path]:
    return sorted(HERE.glob("*.ipynb"))


def scrub(text: str) -> str:
    """Machine paths and log timestamps out of an output's text."""
    for path, name in ((str(REPO), "."), (tempfile.gettempdir(), "<tmp>"), (str(Path.home()), "~")):
        text = text.replace(path, name)
    return _LOG_TIME.sub("", text)


def normalize(notebook) -> None:
    notebook.metadata.pop("widgets", None)
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)  # nbclient's start and end times
        for output in cell.get("outputs", []):
            if "text" in output:
                output["text"] = scrub(output["text"])
            for key in ("text/plain", "text/html"):
                if key in output.get("data", {}):
                    output["data"][key] = scrub(output["data"][key])


def execute(path: Path, timeout: int = 600):
    """The notebook at `path`, executed in a fresh kernel with the repository as its working directory."""
    notebook = nbformat.read(path, as_version=4)
    env_before = os.environ.get("JAX_PLATFORMS")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the kernel inherits it
    try:
        NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(REPO)}}).execute()
    finally:
        if env_before is None:
            os.environ.pop("JAX_PLATFORMS", None)
    normalize(notebook)
    return notebook


def main(argv: list[str]) -> int:
    chosen = [p for p in notebooks() if not argv or p.stem in argv]
    for path in chosen:
        start = time.perf_counter()
        notebook = execute(path)
        nbformat.write(notebook, path)
        print(f"{path.name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
