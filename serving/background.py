"""The OpenAI-compatible server in a background thread of this process, over an `LLM` already built: for a
notebook, or a model registered in this process (`paged.register_model`) that `paged serve` could not import.

    from paged.serving.background import BackgroundServer
    with BackgroundServer(llm) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")

The same app `paged serve` runs (routes, metrics, limits at their defaults); the engine's thread starts with it
and stops when the block ends. The LLM must not be used directly meanwhile: the server's engine thread steps it.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from paged.serving.app import build_app
from paged.serving.async_engine import AsyncEngine
from paged.serving.metrics import EngineMetrics


class BackgroundServer:
    def __init__(self, llm, host: str = "127.0.0.1", port: int = 0, served_model_name: str | None = None):
        """`port` 0: a free port (see `url`)."""
        if port == 0:
            with socket.socket() as probe:
                probe.bind((host, 0))
                port = probe.getsockname()[1]
        self.url = f"http://{host}:{port}"
        name = served_model_name or llm.engine.model_name
        metrics = EngineMetrics(name)
        app = build_app(AsyncEngine(llm.engine, observer=metrics), name, metrics)
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="paged-background-server", daemon=True)

    def start(self, timeout_s: float = 60) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the background server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
