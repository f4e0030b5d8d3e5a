"""Starts `paged serve` as a real subprocess on 127.0.0.1 and waits until it is healthy."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`paged serve` on a free port; with `wait=False` the caller calls `wait_healthy()` (start several at
    once)."""

    def __init__(self, model_dir: str, *extra: str, env: dict[str, str] | None = None, wait: bool = True,
                 cwd: str | None = None, eager: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
        self.log = open(os.path.join(model_dir, f"server-{self.port}.log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "paged.serving.cli", "serve", "--model", model_dir, "--port", str(self.port),
             "--served-model-name", "tiny", *(["--enforce-eager"] if eager else []), *extra],  # eager: shapes
            # compile on first use
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        if wait:
            self.wait_healthy()

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not become healthy in {timeout:.0f} s")

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
