"""Checks of what `pip install` brings, run by CI (.ci/run) and by tests/test_packaging.py.

    python requirements/check_packaging.py runtime    # paged's runtime dependencies pull no test stack
    python requirements/check_packaging.py installed  # this environment has neither torch nor pytest
    python requirements/check_packaging.py extras     # [cuda], [cuda13], [tpu] resolve against the registry

`runtime` walks the requirement graph of the installed `paged` distribution (no extras) through the installed
distributions' own metadata; `extras` asks pip to resolve each accelerator extra with the runtime pins, a dry
run that downloads metadata but no wheels.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
TEST_STACK = ("torch", "pytest")  # what a runtime install must never bring
# extra -> the distribution that proves the accelerator's jax plugin was resolved
ACCELERATOR_EXTRAS = {"cuda": "jax-cuda12-plugin", "cuda13": "jax-cuda13-plugin", "tpu": "libtpu"}


def runtime_closure(root: str = "paged", extras: tuple[str, ...] = ()) -> dict[str, str]:
    """Installed distribution name -> version for everything `root` (with `extras`; none: the runtime) needs,
    itself included."""
    environment = default_environment()
    seen: dict[str, str] = {}
    todo = [(root, extras)]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in seen and not extras:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is required (by the closure of {root}) but not installed")
        seen[key] = dist.version
        for line in dist.requires or ():
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({**environment, "extra": e}) for e in (*extras, "")):
                todo.append((req.name, tuple(req.extras)))
    return seen


def check_runtime() -> None:
    closure = runtime_closure()
    bad = sorted(set(closure) & set(TEST_STACK))
    if bad:
        raise SystemExit(f"paged's runtime dependencies pull in {', '.join(bad)}")
    print(f"runtime closure: {len(closure)} distributions, none of {', '.join(TEST_STACK)}")


def check_installed() -> None:
    present = []
    for name in TEST_STACK:
        try:
            present.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    if present:
        raise SystemExit(f"this environment should hold the runtime only, but has {', '.join(present)}")
    print(f"installed: none of {', '.join(TEST_STACK)}")


def check_extras() -> None:
    pins = REPO / "requirements" / f"py{sys.version_info.major}{sys.version_info.minor}.txt"
    for extra, plugin in ACCELERATOR_EXTRAS.items():
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.json"
            result = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                 "--report", str(report), "-c", str(pins), f"{REPO}[{extra}]"],
                capture_output=True, text=True)
            if result.returncode:
                raise SystemExit(f"[{extra}] does not resolve:\n{result.stderr[-3000:]}")
            resolved = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
                        for item in json.loads(report.read_text())["install"]}
        if plugin not in resolved:
            raise SystemExit(f"[{extra}] resolved without {plugin}: {sorted(resolved)}")
        print(f"[{extra}] resolves: jax {resolved.get('jax')}, {plugin} {resolved[plugin]}, "
              f"{len(resolved)} distributions")


if __name__ == "__main__":
    checks = {"runtime": check_runtime, "installed": check_installed, "extras": check_extras}
    if len(sys.argv) != 2 or sys.argv[1] not in checks:
        raise SystemExit(f"usage: {sys.argv[0]} {'|'.join(checks)}")
    checks[sys.argv[1]]()
