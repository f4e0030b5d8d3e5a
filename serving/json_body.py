"""JSON off the event loop: non-streamed replies built and encoded in a worker thread, large request bodies
decoded in one.

A reply with n = 64 samples of 490 tokens and 20 top logprobs each is ~46 MB of JSON; built and encoded on the
event loop (FastAPI's encoder walks it in Python), it held every other request, `/health` included, for
18 s. Here the handler's `build()` runs in the server's worker pool, and the encoder works in small pieces
(each small container is one `json.dumps` call), so the interpreter hands the event loop its turn between
them (the GIL's switch interval) however large the reply.

A request body is decoded on the loop by FastAPI, with `json.loads`: one C call, which holds the interpreter
for its whole length (a 4 MiB body of 524,000 two-token prompts: 0.2 s on an idle 2-core machine, seconds
under load). A body of OFF_LOOP_BYTES or more is decoded instead by the standard library's pure-Python
decoder (the same JSON, strings still scanned in C) in a thread of its own: about 9x slower for that body,
but the interpreter switches between its values, so the loop and every other request go on.
"""

from __future__ import annotations

import asyncio
import json
import json.scanner
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

# A list or dict with at most this many elements, none of them a container, is encoded in one call.
_FLAT = 64
_dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def _flat(values) -> bool:
    return len(values) <= _FLAT and not any(isinstance(v, (dict, list, tuple)) for v in values)


def _pieces(obj, out: list[str]) -> None:
    if isinstance(obj, dict):
        if _flat(obj.values()):
            out.append(_dumps(obj))
            return
        out.append("{")
        for i, (key, value) in enumerate(obj.items()):
            if not isinstance(key, str):
                raise TypeError(f"JSON object keys must be strings, got {type(key).__name__}")
            out.append(("," if i else "") + _dumps(key) + ":")
            _pieces(value, out)
        out.append("}")
    elif isinstance(obj, (list, tuple)):
        if _flat(obj):
            out.append(_dumps(obj))
            return
        out.append("[")
        for i, value in enumerate(obj):
            if i:
                out.append(",")
            _pieces(value, out)
        out.append("]")
    else:
        out.append(_dumps(obj))


def encode(obj) -> bytes:
    """Strict JSON (no NaN or infinity), UTF-8, compact: the same bytes as one `json.dumps` call would give."""
    out: list[str] = []
    _pieces(obj, out)
    return "".join(out).encode("utf-8")


async def json_reply(state, build: Callable[[], dict]) -> Response:
    """`build()` (which assembles the reply from finished outputs) and its encoding, in a worker thread."""
    body = await state.in_worker(lambda: encode(build()))
    return Response(content=body, media_type="application/json")


# Bodies at least this large are decoded off the loop.
OFF_LOOP_BYTES = 256 * 2**10
_piecewise = json.JSONDecoder()
_piecewise.scan_once = json.scanner.py_make_scanner(_piecewise)  # the pure-Python scanner: switchable
# One thread: large bodies queue behind each other instead of each taking a core from the engine.
_decoder_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paged-json-body")


def decode_in_pieces(body: bytes):
    """json.loads(body), by the pure-Python decoder (the same values and errors)."""
    return _piecewise.decode(body.decode("utf-8"))


class OffLoopJSONRequest(Request):
    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) < OFF_LOOP_BYTES:
                self._json = json.loads(body)
            else:
                self._json = await asyncio.get_running_loop().run_in_executor(_decoder_thread, decode_in_pieces,
                                                                              body)
        return self._json


class OffLoopJSONRoute(APIRoute):
    """A route whose JSON body, when large, is decoded off the event loop (OffLoopJSONRequest)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(OffLoopJSONRequest(request.scope, request.receive))

        return route
