"""The README's code blocks, run as written (offline): the Python API, `paged serve` and the clients against it.

A block preceded by `<!-- readme: not run (why) -->` is left out, with its reason in the README itself (the
`make` commands CI runs first, installs that need the registry, minutes-long benchmarks). The one marked
`<!-- readme: server -->` is started in the background, and the blocks that talk to 127.0.0.1:8000 run
against it. Two substitutions only: `.venv/bin/` becomes this interpreter's directory, port 8000 a free one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.serving.server_fixture import free_port

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"(?:<!-- readme: (?P<note>[^>]*?) -->\n)?```(?P<lang>\w+)\n(?P<code>.*?)```", re.S)


def readme_blocks() -> list[tuple[str, str, str | None]]:
    """(language, code, note) of every fenced block, in order."""
    text = (REPO / "README.md").read_text()
    return [(m["lang"], m["code"], m["note"]) for m in FENCE.finditer(text)]


def test_every_block_that_is_not_run_says_why():
    for lang, code, note in readme_blocks():
        assert lang in ("bash", "python"), lang
        if note is not None:
            assert note == "server" or re.fullmatch(r"not run \(.+\)", note), note


def _as_here(code: str, port: int) -> str:
    return code.replace(".venv/bin/", str(Path(sys.executable).parent) + "/").replace(":8000", f":{port}") \
        .replace("--port 8000", f"--port {port}")


def _run(lang: str, code: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, f"README block failed:\n{code}\n--- stderr:\n{done.stderr[-3000:]}"
    return done


def test_the_readme_runs_as_written(tmp_path):
    port = free_port()
    server = None
    ran = 0
    try:
        for lang, code, note in readme_blocks():
            code = _as_here(code, port)
            if note is not None and note.startswith("not run"):
                continue
            if note == "server":
                log = open(tmp_path / "server.log", "w")
                server = subprocess.Popen(["bash", "-c", code], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
                _wait_healthy(server, port, tmp_path / "server.log")
                continue
            if f"127.0.0.1:{port}" in code:
                assert server is not None, "a block talks to the server before the README starts one"
            done = _run(lang, code)
            assert done.stdout.strip(), f"README block printed nothing:\n{code}"
            if lang == "bash" and "curl" in code:
                assert json.loads(done.stdout)["choices"][0]["text"]
            ran += 1
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(60)
    assert server is not None and ran >= 4


def _wait_healthy(server: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the README's server exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the README's server did not become healthy:\n{log.read_text()[-3000:]}")
