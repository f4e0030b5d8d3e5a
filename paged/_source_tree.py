"""`paged.models`, `paged.serving`, `paged.kernels` and `paged.benchmarks` live in the repository's top-level
folders (`models/`, `serving/`, `pallas_kernels/`, `benchmarks/`); an install lays them out under `paged/`, as
pyproject.toml's package-dir table says. A checkout that was never installed (a script run where only jax is,
`python -c` in the repository) finds them through this finder, which reads the same table. It goes first, so
the subpackages always come from the same tree as `paged` itself (a second checkout beside an editable install
imports its own)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import tomllib
from pathlib import Path


class SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds each subpackage that package-dir maps to a folder of its own (their submodules follow the
    package's `__path__` as usual)."""

    def __init__(self, folders: dict[str, Path]):
        self.folders = folders

    def find_spec(self, fullname, path=None, target=None):
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def register() -> None:
    """Adds the finder when paged runs from a checkout (pyproject.toml beside it); an installed wheel has the
    subpackages in place and no pyproject.toml."""
    root = Path(__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file() or any(isinstance(f, SourceTreeFinder) for f in sys.meta_path):
        return
    table = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"]
    sys.meta_path.insert(0, SourceTreeFinder({name: root / folder for name, folder in table.items()}))
