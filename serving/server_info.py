"""GET /v1/models, /health and /metrics: what probes, scrapers and clients ask about the server."""

from __future__ import annotations

import contextlib

from fastapi.responses import Response

from paged.serving.async_engine import EngineDeadError
from paged.serving.errors import APIError, error_response
from paged.serving.generation import check_model
from paged.serving.state import State


def _card(state) -> dict:
    name = state.served_model_name
    engine = state.engine
    task = engine.pooling_task if engine.runner_type == "pooling" else "generate"
    return {"id": name, "object": "model", "created": state.created, "owned_by": "paged",
            "root": state.model_path or name, "parent": None, "max_model_len": state.max_model_len,
            "task": task}  # generate, embed or classify: which routes the model answers


def _adapter_card(state, adapter) -> dict:
    """A LoRA adapter, as vLLM lists it: its path as root, the base model as parent."""
    return {**_card(state), "id": adapter.lora_name, "root": adapter.lora_path,
            "parent": adapter.base_model_name or state.served_model_name}


async def models(state: State):
    """GET /v1/models: the base model, then its LoRA adapters"""
    return {"object": "list", "data": [_card(state), *(_adapter_card(state, a) for a in state.lora_adapters.values())]}


async def model(model: str, state: State):
    """GET /v1/models/{model} (the openai client's `models.retrieve`)"""
    adapter = check_model(state, model)
    return _card(state) if adapter is None else _adapter_card(state, adapter)


async def version():
    """GET /version"""
    from paged.serving.cli import _version
    return {"version": _version()}


async def health(state: State):
    """GET /health: 200 with an empty body while the engine runs, else 503."""
    if not state.engine.alive:
        return error_response(APIError(503, "the engine is not running", type_="server_error"))
    return Response(status_code=200)


async def prometheus_metrics(state: State):
    """GET /metrics: Prometheus text format."""
    metrics = state.metrics
    if metrics is None:
        return Response(b"", media_type="text/plain; version=0.0.4; charset=utf-8")
    for replica in state.engine.replicas:  # gauges as of now, not as of the last step
        with contextlib.suppress(EngineDeadError):
            await replica.call(metrics.update_gauges)
            await replica.call(metrics.update_on_scrape)
    body = metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
