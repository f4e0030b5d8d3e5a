"""What `pip install -e .` brings: the runtime only. The accelerator extras' resolution needs the registry and
runs in CI (`make check-packaging`); this reads the installed distributions' own requirements."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_packaging", REPO / "requirements" / "check_packaging.py")
check_packaging = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_packaging)


def test_the_runtime_pulls_neither_torch_nor_pytest():
    closure = check_packaging.runtime_closure()
    assert {"jax", "flax", "transformers", "safetensors", "fastapi", "uvicorn"} <= set(closure)
    assert not set(closure) & {"torch", "pytest"}, sorted(closure)


def test_the_closure_would_see_pytest_if_it_were_required():
    # The walk is not vacuous: with the [test] extra it reaches pytest through paged's installed metadata.
    assert "pytest" in check_packaging.runtime_closure("paged", extras=("test",))


def test_every_accelerator_extra_names_jax_with_its_plugin():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(check_packaging.ACCELERATOR_EXTRAS) <= set(extras)
    for name in check_packaging.ACCELERATOR_EXTRAS:
        assert any(req.startswith("jax[") for req in extras[name]), (name, extras[name])


def test_the_demo_model_ships_with_the_package():
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "demo_model/checkpoint/*" in package_data["models"]
    assert (REPO / "models" / "demo_model" / "checkpoint" / "model.safetensors").is_file()
