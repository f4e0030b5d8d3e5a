"""Non-streamed replies built and encoded in a worker thread, never on the event loop.

A reply with n = 64 samples of 490 tokens and 20 top logprobs each is ~46 MB of JSON; built and encoded on the
event loop (FastAPI's encoder walks it in Python), it held every other request, `/health` included, for
18 s. Here the handler's `build()` runs in the server's worker pool, and the encoder works in small pieces
(each small container is one `json.dumps` call), so the interpreter hands the event loop its turn between
them (the GIL's switch interval) however large the reply.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi.responses import Response

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
