"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters added and removed while the server
runs, behind vLLM's switch (VLLM_ALLOW_RUNTIME_LORA_UPDATING=true; without it the routes do not exist).

An adapter is read on every replica's engine thread before it is listed, so a request naming it never finds
it missing; removing one lets the requests running with it finish first. Replies are vLLM's: plain text on
success, its 400 and 404 messages otherwise."""

from __future__ import annotations

import itertools
import os

from fastapi.responses import PlainTextResponse

from paged.lora import LoRARequest
from paged.serving.async_engine import EngineDeadError
from paged.serving.errors import APIError
from paged.serving.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from paged.serving.state import ServerState, State

_ids = itertools.count(1)


def runtime_updates_allowed() -> bool:
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")


def new_lora_request(name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
    """A LoRARequest with an id no other adapter of this process has."""
    return LoRARequest(name, next(_ids), path, base_model_name)


async def add_adapter(state: ServerState, request: LoRARequest) -> None:
    """Reads `request`'s adapter on every replica (ValueError when it cannot serve it), then lists it."""
    for replica in state.engine.replicas:
        await replica.call(lambda engine: engine.load_adapter(request))
    state.lora_adapters[request.lora_name] = request


async def load_lora_adapter(body: LoadLoRAAdapterRequest, state: State):
    """POST /v1/load_lora_adapter {"lora_name", "lora_path"}"""
    if not body.lora_name or not body.lora_path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
    if not state.engine.config.enable_lora:
        raise APIError(400, "LoRA is not enabled on this server (start it with --enable-lora)")
    if body.lora_name in state.lora_adapters or body.lora_name in state.model_names:
        raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name")
    if not os.path.isdir(body.lora_path):
        raise APIError(404, f"No adapter found for {body.lora_path}", param="lora_path", code="not_found")
    try:
        await add_adapter(state, new_lora_request(body.lora_name, body.lora_path))
    except ValueError as exc:
        raise APIError(400, str(exc), param="lora_path") from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), type_="server_error") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, state: State):
    """POST /v1/unload_lora_adapter {"lora_name"}"""
    if not body.lora_name:
        raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.")
    if body.lora_name not in state.lora_adapters:
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                       code="not_found")
    del state.lora_adapters[body.lora_name]  # new requests no longer find it
    for replica in state.engine.replicas:
        try:
            await replica.call(lambda engine: engine.remove_adapter(body.lora_name))
        except EngineDeadError as exc:
            raise APIError(503, str(exc), type_="server_error") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


LORA_ROUTES = [
    ("/v1/load_lora_adapter", load_lora_adapter, ["POST"], {"description": "adds a LoRA adapter (plain text)"}),
    ("/v1/unload_lora_adapter", unload_lora_adapter, ["POST"], {"description": "removes one (plain text)"}),
]
