"""Errors in OpenAI's shape: `APIError` is what a handler raises, `error_response` what the client gets."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from paged.serving.async_engine import EngineDeadError, RequestFailedError, StreamStalledError


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}


# Seconds a client should wait before retrying a 503 (overloaded or restarting).
RETRY_AFTER_S = 1


def error_body(err: APIError) -> dict:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def error_response(err: APIError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 503 else {}
    return JSONResponse(error_body(err), status_code=err.status, headers={**headers, **err.headers})


def outcome_of(err: APIError) -> str:
    """The `paged:api_requests` outcome of a request that ended with `err` (see paged.serving.metrics.OUTCOMES)."""
    if err.status == 503:
        return "overloaded" if err.code == "overloaded" else "unavailable"
    if err.code == "stream_stalled":
        return "aborted"  # the client stopped reading
    return {401: "unauthorized", 429: "rate_limited"}.get(err.status, "invalid" if err.status < 500 else "failed")


def api_error_of(exc: BaseException) -> APIError:
    """What a failure of a request's stream becomes for the client."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type_="server_error")
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), type_="server_error")
    if isinstance(exc, StreamStalledError):
        return APIError(408, str(exc), code="stream_stalled", type_="timeout_error")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")
