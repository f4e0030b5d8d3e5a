"""One variable, $PAGED_CACHE_DIR, moves everything the project keeps between runs."""

from __future__ import annotations

from pathlib import Path

import paged.benchmarks.common
import paged.models.tiny
from paged import compilation_cache
from paged.kernels import cpu
from paged.kernels.cache import cache_root


def test_one_variable_moves_every_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path))
    made = []
    monkeypatch.setattr(paged.models.tiny, "create_tiny_llama", lambda directory, **_: made.append(directory))
    assert cache_root() == tmp_path
    assert compilation_cache.default_dir() == tmp_path / "xla"
    assert cpu._cache_dir() == tmp_path / "kernels"
    assert Path(paged.models.tiny.default_tiny_model_dir()).parent == tmp_path
    assert Path(paged.benchmarks.common.default_model_dir()).is_relative_to(tmp_path)
    assert len(made) == 2  # neither model existed there: both were built under the new root


def test_default_root_and_tilde(monkeypatch):
    monkeypatch.delenv("PAGED_CACHE_DIR", raising=False)
    assert cache_root() == Path.home() / ".cache" / "paged"
    monkeypatch.setenv("PAGED_CACHE_DIR", "~/elsewhere")
    assert cache_root() == Path.home() / "elsewhere"
