"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI): `build_app` wires the route families (one
module each: completions, chat, tokenization, server_info), the error handlers in OpenAI's shape, the body
limit and bearer-key middlewares, and the OpenAPI document.

Each handler is a module-level function of its parsed body, the raw request and the state (a FastAPI
dependency), so it can be called alone in a test.
"""

from __future__ import annotations

import contextlib
import gc
import reprlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged.serving.api_keys import ANONYMOUS, ApiKey, KeyRing
from paged.serving.async_engine import AsyncEngine
from paged.serving.chat import chat_completions
from paged.serving.responses import responses, stored_response
from paged.serving.completions import completions
from paged.serving.errors import APIError, error_response
from paged.serving.json_body import OffLoopJSONRoute
from paged.serving.metrics import EngineMetrics
from paged.serving.pooling import classify, embeddings, pooling, rerank, score
from paged.serving.protocol import (ChatCompletionResponse, CompletionResponse, DetokenizeResponse, ErrorResponse,
                                    ModelCard, ModelList, TokenizeResponse)
from paged.serving.replicas import ReplicatedEngine
from paged.serving.server_info import health, model, models, prometheus_metrics, version
from paged.serving.state import ServerLimits, ServerState, key_name
from paged.serving.tokenization import detokenize, tokenize


async def _api_error(_, exc: APIError):
    return error_response(exc)


def _count_refused(request: Request, outcome: str) -> None:
    """Counts a generation request refused before its handler ran (a body that does not parse)."""
    route, metrics = GENERATION_ROUTES.get(request.url.path), request.app.state.paged.metrics
    if route is not None and metrics is not None:
        metrics.count_request(key_name(request), route, outcome)


async def _validation_error(request: Request, exc: RequestValidationError):
    _count_refused(request, "invalid")
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return error_response(APIError(400, f"malformed JSON body: {first.get('msg', '')}"))
    where = ".".join(loc) or "body"
    return error_response(APIError(400, f"{where}: {first.get('msg', 'invalid value')} "
                                        f"(got {_SHORT_REPR.repr(first.get('input'))})"[:500],
                                   param=loc[0] if loc else None))


# What a 400 quotes of the value it refuses: bounded before it is built (repr() of a 4 MiB batch took 0.1 s).
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxstring, _SHORT_REPR.maxother, _SHORT_REPR.maxlong = 3, 160, 80, 80
_SHORT_REPR.maxlist = _SHORT_REPR.maxtuple = _SHORT_REPR.maxdict = 6


async def _http_error(request: Request, exc: StarletteHTTPException):
    """Starlette's own errors (unknown route 404, wrong method 405 with its Allow header, an unreadable body
    400, a body over the limit 413) in OpenAI's shape."""
    _count_refused(request, "invalid")
    message = str(exc.detail)
    if exc.status_code == 404 and message == "Not Found":  # no route: say so (a model's 404 says which model)
        message = f"the route {request.method} {request.url.path} does not exist on this server"[:500]
    response = error_response(APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None))
    response.headers.update(exc.headers or {})
    return response


async def _internal(_, exc: Exception):
    if isinstance(exc, RecursionError):  # a JSON body nested deeper than the parser recurses
        return error_response(APIError(400, "malformed JSON body: nested too deeply"))
    return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))


class BodyLimit:
    """A 413 in OpenAI's shape for a body over `max_bytes`, by its Content-Length or as it arrives."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"the request body is larger than this server's limit of {self.max_bytes} bytes",
                             code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await error_response(too_large)(scope, receive, send)
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise StarletteHTTPException(413, too_large.message)
            return message

        await self.app(scope, counting_receive, send)


# Routes open without a key: probes and scrapers (a load balancer's health check, Prometheus) carry none.
OPEN_ROUTES = ("/health", "/metrics", "/openapi.json", "/version")
GENERATION_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions",
                     "/v1/embeddings": "embeddings", "/pooling": "pooling", "/classify": "classify",
                     "/score": "score", "/v1/score": "score", "/rerank": "rerank", "/v1/rerank": "rerank",
                     "/v2/rerank": "rerank"}


class BearerAuth:
    """When the server has keys, requires `Authorization: Bearer KEY` with one of them on every route but
    OPEN_ROUTES, and puts the key in `scope["paged.api_key"]` for the handlers (limits, metrics).

    A plain ASGI middleware, not Starlette's BaseHTTPMiddleware: that one stands between the route and the
    connection, so `request.is_disconnected()` never saw a client leave and non-streamed requests ran on.
    """

    def __init__(self, app, keys: KeyRing, metrics: EngineMetrics | None = None):
        self.app, self.keys, self.metrics = app, keys, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys.required or scope["path"] in OPEN_ROUTES:
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        key = self.keys.identify(token)
        if key is not None:
            scope["paged.api_key"] = key
            return await self.app(scope, receive, send)
        route = GENERATION_ROUTES.get(scope["path"])
        if route is not None and self.metrics is not None:
            self.metrics.count_request(ANONYMOUS, route, "unauthorized")
        response = error_response(APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                           code="invalid_api_key"))
        await response(scope, receive, send)


_JSON_ERRORS = {status: {"model": ErrorResponse, "description": description} for status, description in (
    (400, "invalid request (the error's `param` names the field)"), (401, "missing or wrong API key"),
    (429, "over the API key's requests or tokens per minute (with Retry-After)"),
    (404, "unknown model (or stored response)"), (413, "request body over the server's limit"),
    (500, "the step carrying this request failed; the server goes on"),
    (503, "overloaded or the engine is not running (with Retry-After)"))}
# One server-sent event: `data: {json chunk}`, the last one `data: [DONE]` (a failure: `data: {"error": ...}`).
_SSE = {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a JSON chunk, an error, or [DONE]"}, "event": {"type": "string"}}}}}

# (path, handler, methods, success response for the OpenAPI document)
ROUTES = [
    ("/v1/completions", completions, ["POST"],
     {"model": CompletionResponse, "content": _SSE, "description": "the completion (a stream with stream=true)"}),
    ("/v1/chat/completions", chat_completions, ["POST"],
     {"model": ChatCompletionResponse, "content": _SSE, "description": "the completion (a stream with stream=true)"}),
    ("/v1/responses", responses, ["POST"],
     {"content": _SSE, "description": "the response object (a stream of Responses events with stream=true)"}),
    # One route for both methods, so a 405 lists both in its Allow header.
    ("/v1/responses/{response_id}", stored_response, ["GET", "DELETE"],
     {"description": "GET: a stored response (404 once evicted or expired, or made with another API key); "
                     "DELETE: drops it ({\"id\": ..., \"object\": \"response\", \"deleted\": true})"}),
    # A pooling model's routes (the model decides which answer: a generating model's are 400s naming the
    # routes it serves, and the other way round).
    ("/v1/embeddings", embeddings, ["POST"], {"description": "an embedding per input (OpenAI's shape)"}),
    ("/pooling", pooling, ["POST"], {"description": "the pooled vector per input"}),
    ("/classify", classify, ["POST"], {"description": "a classifier's label probabilities per input"}),
    *[(path, score, ["POST"], {"description": "a relevance score per pair of texts"})
      for path in ("/score", "/v1/score")],
    *[(path, rerank, ["POST"], {"description": "the documents by relevance to the query"})
      for path in ("/rerank", "/v1/rerank", "/v2/rerank")],
    ("/v1/models", models, ["GET"], {"model": ModelList, "description": "the served model"}),
    ("/v1/models/{model}", model, ["GET"], {"model": ModelCard, "description": "the served model"}),
    ("/version", version, ["GET"], {"description": "the server's version: {\"version\": \"...\"}"}),
    ("/health", health, ["GET", "HEAD"], {"description": "the engine runs (no body)"}),
    ("/tokenize", tokenize, ["POST"], {"model": TokenizeResponse, "description": "token ids"}),
    ("/detokenize", detokenize, ["POST"], {"model": DetokenizeResponse, "description": "text"}),
    ("/metrics", prometheus_metrics, ["GET"],
     {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}),
]


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document, corrected: errors are 400 (never FastAPI's 422) in OpenAI's shape, every route but
    OPEN_ROUTES takes a bearer key, /health answers 200 with no body."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                             description="OpenAI-compatible API of a paged engine")
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                operation["responses"].pop("422", None)
                if path in OPEN_ROUTES:
                    operation["security"] = []
                if path == "/health":
                    operation["responses"] = {"200": {"description": "the engine runs (no body)"},
                                              "503": operation["responses"]["503"]}
        schema["components"].setdefault("securitySchemes", {})["bearer"] = {"type": "http", "scheme": "bearer"}
        schema["security"] = [{"bearer": []}]
        for name in ("HTTPValidationError", "ValidationError"):
            schema["components"]["schemas"].pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def build_app(engine: AsyncEngine | ReplicatedEngine, served_model_name: str, metrics: EngineMetrics | None = None,
              api_keys: list[ApiKey] | None = None, model_path: str | None = None,
              limits: ServerLimits = ServerLimits(), tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, lora_adapters: list | None = None) -> FastAPI:
    """The app starts the engine thread on startup and stops it (aborting what is left) on shutdown.

    `api_keys`: none, an open server; otherwise every route but OPEN_ROUTES needs one of them, and each key's
    limits apply to its generation requests (token limits need `metrics`, which sees the tokens generated).
    `lora_adapters`: the LoRARequests served by name (`--lora-modules`; each replica has read them already)."""
    keys = KeyRing(api_keys or [])
    if keys.limits_tokens and metrics is None:
        raise ValueError("tokens_per_minute limits need the server's metrics (they count generated tokens)")
    if metrics is not None:
        metrics.usage_hook = keys.charge
        metrics.describe(engine.engine)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if not engine.started:
            engine.start()
        # What start-up made (jax, the model, tokenizers: millions of objects) lives as long as the server:
        # the collector stops walking it, so a full collection walks what requests made, not the whole heap
        # (held with the interpreter, a collection is a pause for every request and /health).
        gc.freeze()
        yield
        engine.stop()

    app = FastAPI(title="paged", version="0.1.0", lifespan=lifespan)
    app.state.paged = ServerState(engine, served_model_name, metrics, keys, model_path, limits, tool_call_parser,
                                  reasoning_parser, lora_adapters={a.lora_name: a for a in lora_adapters or []})
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    app.add_middleware(BearerAuth, keys=keys, metrics=metrics)
    app.add_middleware(BodyLimit, max_bytes=limits.max_request_body_bytes)  # outermost: before auth reads it
    app.router.route_class = OffLoopJSONRoute  # large request bodies are decoded off the event loop
    from paged.serving.lora_routes import LORA_ROUTES, runtime_updates_allowed
    for path, handler, methods, success in [*ROUTES, *(LORA_ROUTES if runtime_updates_allowed() else [])]:
        app.add_api_route(path, handler, methods=methods, response_model=None,
                          responses={200: success, **_JSON_ERRORS})
    app.openapi = lambda: _openapi(app)
    return app
