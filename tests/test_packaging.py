"""What `pip install -e .` brings: the runtime only, under one package. The accelerator extras' resolution needs
the registry and runs in CI (`make check-packaging`); this reads the installed distributions' own requirements,
builds the wheel, and runs paged from a folder whose own modules share our subpackages' names."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import httpx

from tests.serving.server_fixture import Server

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


def test_the_wheel_holds_one_package_with_the_demo_model_and_the_kernel_sources(tmp_path):
    """What `pip install .` puts into site-packages is the wheel's content: `paged` and its metadata, nothing
    else at the top level (no `models`, `serving`, ... to collide with other packages)."""
    source = tmp_path / "source"  # a copy: setuptools writes its build folders beside the sources
    for name in ("paged", "models", "serving", "pallas_kernels", "benchmarks"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(source)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("paged-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"paged", wheel.name.split("-py")[0] + ".dist-info"}, \
        sorted({name.split("/")[0] for name in names})
    assert "paged/models/demo_model/checkpoint/model.safetensors" in names
    assert {"paged/kernels/cpu/matmul.cc", "paged/kernels/cpu/bf16.h", "paged/serving/app.py",
            "paged/benchmarks/throughput.py"} <= set(names)
    assert "paged/_source_tree.py" in names and "pyproject.toml" not in names  # the finder stays idle there


def _shadowing_folder(path: Path) -> Path:
    """A notebook's folder with its own modules named like the repository's folders: importing any of them
    instead of paged's own fails loudly."""
    for name in ("models", "serving", "pallas_kernels"):
        (path / f"{name}.py").write_text(f"raise ImportError('the folder\\'s own {name}.py was imported')\n")
    (path / "benchmarks").mkdir()
    (path / "benchmarks" / "__init__.py").write_text("raise ImportError('the folder\\'s own benchmarks/')\n")
    return path


def test_paged_runs_from_a_folder_that_shadows_its_subpackage_names(tmp_path, tiny_model_dir):
    folder = _shadowing_folder(tmp_path)
    script = textwrap.dedent(f"""
        import paged
        llm = paged.LLM({tiny_model_dir!r}, max_model_len=64, num_kv_blocks=16)
        out = llm.generate(["Hello"], paged.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                           use_tqdm=False)
        print(len(out[0].outputs[0].token_ids))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=folder, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "4"
    server = Server(tiny_model_dir, cwd=str(folder))  # `python -m paged.serving.cli serve`: the folder is on sys.path
    try:
        reply = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        server.stop()
