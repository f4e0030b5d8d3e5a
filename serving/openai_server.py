"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI): route handlers over one `ServerState`.

Each handler is a module-level function of its parsed body, the raw request and the state (a FastAPI
dependency), so it can be called alone in a test. `build_app` only wires them, the error handlers and the
auth middleware to an app.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged import InvalidStructuredOutput, InvalidTokenIds, RequestOutput, SamplingParams
from paged.chat import chat_prompt_token_ids, text_token_ids
from serving.api_keys import ANONYMOUS, ApiKey, KeyRing, RateLimited
from serving.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestFailedError, RequestStream
from serving.metrics import EngineMetrics
from serving.replicas import ReplicatedEngine
from serving.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                              DetokenizeRequest, DetokenizeResponse, ErrorResponse, ModelList, TokenizeRequest,
                              TokenizeResponse, message_dicts)
from serving.tool_calls import (PARSERS, ToolCallStream, constrained_calls, functions_of, tool_choice_mode,
                                tool_constraint)


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
    """The `paged:api_requests` outcome of a request that ended with `err` (see serving.metrics.OUTCOMES)."""
    if err.status == 503:
        return "overloaded" if err.code == "overloaded" else "unavailable"
    return {401: "unauthorized", 429: "rate_limited"}.get(err.status, "invalid" if err.status < 500 else "failed")


def api_error_of(exc: BaseException) -> APIError:
    """What a failure of a request's stream becomes for the client."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type_="server_error")
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), type_="server_error")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


class EventStream(StreamingResponse):
    """A generation's server-sent events. A failure mid-stream becomes a final error event and `[DONE]`, so a
    client learns why its stream ended instead of seeing it cut; `on_end(outcome)`, when set, is called once
    the stream has ended (an outcome of serving.metrics.OUTCOMES). `X-Accel-Buffering: no` keeps a proxy
    such as nginx from holding events back."""

    def __init__(self, events: AsyncIterator[str]):
        self.on_end = None
        super().__init__(self._with_errors(events), media_type="text/event-stream",
                         headers={"X-Accel-Buffering": "no", "Cache-Control": "no-cache"})

    async def _with_errors(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        outcome = "aborted"  # the client left before the end
        try:
            async for event in events:
                yield event
            outcome = "ok"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the client, in OpenAI's error shape
            err = api_error_of(exc)
            outcome = outcome_of(err)
            yield _sse(error_body(err))
            yield _sse("[DONE]")
        finally:
            if self.on_end is not None:
                self.on_end(outcome)


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one request may make the server do (`paged serve` flags)."""

    # Larger bodies are a 413 before any of it is parsed.
    max_request_body_bytes: int = 4 * 2**20
    # A client's own `chat_template` runs Jinja on this server: only when the operator allows it (vLLM keeps
    # this behind a flag too).
    allow_request_chat_template: bool = False


@dataclasses.dataclass
class ServerState:
    """What every handler reads: the engine and the server's settings."""

    engine: AsyncEngine | ReplicatedEngine  # one engine, or data-parallel replicas behind one interface
    served_model_name: str
    metrics: EngineMetrics | None = None
    keys: KeyRing = dataclasses.field(default_factory=lambda: KeyRing([]))  # none: no auth, no limits
    model_path: str | None = None
    limits: ServerLimits = ServerLimits()
    tool_call_parser: str | None = None  # finds calls in tool_choice=auto outputs; None: auto is refused
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    # Tokenization and chat templates run here, off the event loop and the engine thread.
    workers: ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=2, thread_name_prefix="paged-tokenize"))

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """Text longer than this cannot fit max_model_len tokens (no token is longer than the vocabulary's
        longest), so it is refused without tokenizing it."""
        tokenizer = self.tokenizer
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer is not None else 1
        return self.max_model_len * max(longest, 1)

    async def in_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.engine.model_config.vocab_size

    @property
    def model_names(self) -> set[str]:
        return {self.served_model_name} | ({self.model_path} if self.model_path else set())


def _state(request: Request) -> ServerState:
    return request.app.state.paged


State = Annotated[ServerState, Depends(_state)]


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class _Choices:
    """Tracks what has been streamed per (prompt, sample), holding back text that may start a stop string."""

    def __init__(self, params: SamplingParams):
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.sent_text: dict[tuple[int, int], int] = {}
        self.sent_tokens: dict[tuple[int, int], int] = {}

    def delta(self, key, completion, finished: bool) -> tuple[str, int, int]:
        """(new text, first new token index, end token index) for one choice."""
        text = completion.text
        end = len(text) if finished else max(self.sent_text.get(key, 0), len(text) - self.holdback)
        start = self.sent_text.get(key, 0)
        self.sent_text[key] = end
        tok_start = self.sent_tokens.get(key, 0)
        self.sent_tokens[key] = len(completion.token_ids)
        return text[start:end], tok_start, len(completion.token_ids)


# ---- shared by the generation routes ----------------------------------------------------------------


def key_name(raw: Request) -> str:
    """The name of the API key the request came with (set by BearerAuth)."""
    key = raw.scope.get("paged.api_key")
    return key.name if key is not None else ANONYMOUS


def admit(state: ServerState, raw: Request, prompt_tokens: int) -> None:
    """Charges the request to its key's limits: a 429 in OpenAI's shape, with Retry-After, when it is over."""
    name = key_name(raw)
    try:
        state.keys.admit(name, prompt_tokens)
    except RateLimited as exc:
        headers = {f"x-ratelimit-limit-{exc.kind}": str(exc.limit),
                   f"x-ratelimit-remaining-{exc.kind}": str(exc.remaining)}
        if exc.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        raise APIError(429, str(exc), code="rate_limit_exceeded", type_=exc.kind, headers=headers) from None
    if state.metrics is not None:
        state.metrics.count_prompt_tokens(name, prompt_tokens)


def counted(route: str):
    """Counts each request of a generation route once, by key and outcome, in `paged:api_requests`: when the
    handler raises, or for a stream when its last event has been sent."""

    def wrap(handler):
        @functools.wraps(handler)
        async def counting(body, raw: Request, state: State):
            count = (lambda outcome: state.metrics.count_request(key_name(raw), route, outcome)) \
                if state.metrics is not None else (lambda outcome: None)
            try:
                response = await handler(body, raw, state)
            except APIError as err:
                count(outcome_of(err))
                raise
            except asyncio.CancelledError:
                count("aborted")
                raise
            except Exception:
                count("failed")
                raise
            if isinstance(response, EventStream):
                response.on_end = count
            else:
                count("ok")
            return response

        return counting

    return wrap


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_names:
        raise APIError(404, f"the model `{model}` does not exist; this server serves `{state.served_model_name}`",
                       param="model", code="model_not_found")


def refuse_unimplemented(body) -> None:
    """A field that would change what the request means, which this server does not implement yet, is a
    400 naming it: never a 200 with output that ignored it."""
    field = body.unimplemented_field()
    if field is not None:
        raise APIError(400, f"{field} is not supported by this server yet", param=field,
                       code="unsupported_parameter")


def sampling_params(state: ServerState, body, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    max_num_seqs = state.engine.engine.config.max_num_seqs
    if body.n > max_num_seqs:
        raise APIError(400, f"n={body.n} exceeds this server's max_num_seqs={max_num_seqs}", param="n")
    try:
        params = body.sampling_params(max_tokens, logprobs)
    except InvalidStructuredOutput as exc:
        raise APIError(400, str(exc), param=exc.field.split(".")[0])
    except ValueError as exc:
        raise APIError(400, str(exc))
    try:  # the engine checks again on submit, but its errors would name the prompt
        params.check_vocab(state.vocab_size)
    except InvalidTokenIds as exc:
        raise APIError(400, str(exc), param=exc.field)
    return params


async def compile_constraint(state: ServerState, params: SamplingParams, field: str) -> None:
    """Compiles the request's grammar in a worker (the engine thread then finds it cached): a bad schema,
    regex or grammar is a 400 naming `field`, the request's field that holds it."""
    constraint = params.structured_outputs
    if constraint is None:
        return
    grammars = state.engine.engine.grammars
    if grammars is None:
        raise APIError(400, "this server has no tokenizer, which structured outputs need", param=field)
    try:
        await state.in_worker(grammars.compile, constraint)
    except InvalidStructuredOutput as exc:
        raise APIError(400, str(exc) if field == "structured_outputs" else f"{field}: {exc.detail}", param=field)


def constraint_field(body) -> str:
    return "structured_outputs" if body.structured_outputs is not None else "response_format"


def _render_chat(state: ServerState, messages: list[dict], chat_template: str | None,
                 add_generation_prompt: bool, tools: list | None = None) -> list[int]:
    """Runs in a worker: the chat template's token ids (ValueError for what it cannot render or fit)."""
    chars = sum(len(str(m.get("content") or "")) for m in messages)
    if chars > state.max_prompt_chars:
        raise ValueError(f"the messages hold {chars} characters, more than max_model_len={state.max_model_len} "
                         "tokens can hold")
    return chat_prompt_token_ids(state.tokenizer, messages, chat_template=chat_template,
                                 add_generation_prompt=add_generation_prompt, max_chars=state.max_prompt_chars,
                                 tools=tools)


def _tokenize_text(state: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    """Runs in a worker; text longer than max_model_len tokens can hold is refused without tokenizing."""
    if len(text) > state.max_prompt_chars:
        raise ValueError(f"the prompt has {len(text)} characters, more than max_model_len={state.max_model_len} "
                         "tokens can hold")
    return text_token_ids(state.tokenizer, text, add_special_tokens=add_special_tokens)


async def chat_token_ids(state: ServerState, messages: list[dict], chat_template: str | None,
                         add_generation_prompt: bool, tools: list | None = None) -> list[int]:
    if chat_template is not None and not state.limits.allow_request_chat_template:
        raise APIError(400, "this server does not take a chat_template from requests (start it with "
                            "--trust-request-chat-template to allow it)", param="chat_template")
    try:
        return await state.in_worker(_render_chat, state, messages, chat_template, add_generation_prompt, tools)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None


def _prompt_param(prompts: list, index: int) -> str:
    """Which prompt an error names: `prompt`, or `prompt[i]` in a batch."""
    return "prompt" if len(prompts) == 1 else f"prompt[{index}]"


async def tokenize_prompts(state: ServerState, prompts: list[tuple[str | None, list[int] | None]]
                           ) -> list[tuple[str | None, list[int]]]:
    """Text prompts tokenized in a worker (the engine thread only ever gets token ids)."""
    out = []
    for i, (text, ids) in enumerate(prompts):
        if ids is None:
            if state.tokenizer is None:
                raise APIError(400, "this server has no tokenizer: send token ids", param="prompt")
            try:
                ids = await state.in_worker(_tokenize_text, state, text, True)
            except ValueError as exc:
                raise APIError(400, str(exc), param=_prompt_param(prompts, i)) from None
        out.append((text, ids))
    return out


async def submit_all(state: ServerState, prompts: list[tuple[str | None, list[int] | None]],
                     params: SamplingParams, request_id: str, key: str = ANONYMOUS) -> list[RequestStream]:
    """Submits every prompt; their generated tokens are counted (and charged) under API key `key`."""
    streams = []
    try:
        for i, (text, ids) in enumerate(prompts):
            if state.metrics is not None:
                state.metrics.attribute(f"{request_id}-{i}", key)
            streams.append(await state.engine.submit(f"{request_id}-{i}", text, ids, params))
    except ValueError as exc:
        for s in streams:
            s.close()
        raise APIError(400, str(exc), param=_prompt_param(prompts, len(streams)))
    except QueueFullError as exc:
        for s in streams:
            s.close()
        raise APIError(503, str(exc), code="overloaded", type_="server_error")
    except EngineDeadError as exc:
        raise APIError(503, str(exc), type_="server_error")
    return streams


async def run_to_completion(streams: list[RequestStream], raw: Request) -> list[RequestOutput]:
    async def last(stream):
        output = None
        async for output in stream:
            pass
        return output

    async def disconnected():
        # The body has been read: the next message the connection brings is the client leaving. Waiting on
        # it (rather than polling) aborts a dropped request within a step.
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise asyncio.CancelledError  # the client left: closing the streams aborts the requests
        return task.result()
    except (EngineDeadError, RequestFailedError) as exc:
        raise api_error_of(exc) from None
    finally:
        task.cancel()
        watcher.cancel()
        for s in streams:
            s.close()


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for output in stream:
                await queue.put((i, output))
        except Exception as exc:  # noqa: BLE001
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item.finished:
                remaining -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ---- /v1/completions ------------------------------------------------------------------------------


def completion_logprobs(completion, start: int, end: int, k: int, offset: int) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for j in range(start, end):
        token = completion.token_ids[j]
        entry = completion.logprobs[j]
        chosen = entry[token]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        # Keys are decoded strings; byte pieces can decode alike, so the likelier one keeps the key.
        tops: dict[str, float] = {}
        for tid, lp in sorted(entry.items(), key=lambda item: -item[1].logprob):
            if lp.rank is not None and (lp.rank <= k or tid == token):
                tops.setdefault(lp.decoded_token or "", lp.logprob)
        top.append(tops)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


@counted("completions")
async def completions(body: CompletionRequest, raw: Request, state: State):
    """POST /v1/completions"""
    check_model(state, body.model)
    refuse_unimplemented(body)
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported", param="echo")
    params = sampling_params(state, body, body.max_tokens, body.logprobs)
    await compile_constraint(state, params, constraint_field(body))
    tokenizer, served_model_name = state.tokenizer, state.served_model_name
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts = [(prompt, None)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [(None, list(prompt))]
    elif prompt:
        prompts = [(p, None) if isinstance(p, str) else (None, list(p)) for p in prompt]
    else:
        raise APIError(400, "prompt must not be empty", param="prompt")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    prompts = await tokenize_prompts(state, prompts)
    admit(state, raw, sum(len(ids) for _, ids in prompts))
    streams = await submit_all(state, prompts, params, request_id, key_name(raw))
    n = params.n

    def prompt_text(output):
        return output.prompt if output.prompt is not None else tokenizer.decode(output.prompt_token_ids)

    def choice(i, output, c, text, start, end, finished):
        offset = len(prompt_text(output)) if body.echo else 0
        return {"index": i * n + c.index, "text": text,
                "logprobs": completion_logprobs(c, start, end, body.logprobs, offset)
                if body.logprobs is not None else None,
                "finish_reason": c.finish_reason if finished else None,
                "stop_reason": c.stop_reason if finished else None}

    if not body.stream:
        outputs = await run_to_completion(streams, raw)
        choices = [choice(i, o, c, (prompt_text(o) if body.echo else "") + c.text, 0, len(c.token_ids), True)
                   for i, o in enumerate(outputs) for c in o.outputs]
        return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": served_model_name, "choices": choices, "usage": usage(outputs)}

    async def events():
        tracker = _Choices(params)
        finals: dict[int, RequestOutput] = {}
        started: set = set()
        done: set = set()
        include_usage = body.include_usage_in_stream()
        async for i, output in merged(streams):
            for c in output.outputs:
                key = (i, c.index)
                if key in done:
                    continue  # a finished sample of an n > 1 request keeps appearing in later outputs
                finished = c.finish_reason is not None
                text, start, end = tracker.delta(key, c, finished)
                if body.echo and key not in started:
                    text = prompt_text(output) + text
                started.add(key)
                if finished:
                    done.add(key)
                elif not text and start == end:
                    continue
                chunk = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                         "model": served_model_name, "choices": [choice(i, output, c, text, start, end, finished)]}
                if include_usage:
                    chunk["usage"] = None
                yield _sse(chunk)
            if output.finished:
                finals[i] = output
        if include_usage:
            yield _sse({"id": request_id, "object": "text_completion", "created": int(time.time()),
                        "model": served_model_name, "choices": [], "usage": usage(list(finals.values()))})
        yield _sse("[DONE]")

    return EventStream(events())


# ---- /v1/chat/completions -------------------------------------------------------------------------


def chat_logprobs(completion, start: int, end: int, k: int) -> dict:
    content = []
    for j in range(start, end):
        token = completion.token_ids[j]
        entry = completion.logprobs[j]
        item = lambda lp: {"token": lp.decoded_token or "", "logprob": lp.logprob,
                           "bytes": list((lp.decoded_token or "").encode())}
        tops = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)
        content.append({**item(entry[token]), "top_logprobs": [item(lp) for lp in tops]})
    return {"content": content}


def tool_setup(state: ServerState, body: ChatCompletionRequest, params: SamplingParams) -> ToolSetup:
    """Reads tools and tool_choice; `required` and a named function become the request's constraint."""
    try:
        functions = functions_of(body.tools or [])
    except ValueError as exc:
        raise APIError(400, str(exc), param="tools") from None
    try:
        mode, name = tool_choice_mode(body.tool_choice, functions)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tool_choice") from None
    if mode == "auto" and state.tool_call_parser is None:  # also the default when tools are given (as vLLM)
        raise APIError(400, 'tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
                            '--tool-call-parser; or pass tool_choice "required", "none" or a named function',
                       param="tool_choice")
    constraint = tool_constraint(mode, name, functions, body.parallel_tool_calls is not False)
    if constraint is not None:
        if params.structured_outputs is not None:
            raise APIError(400, f"tool_choice={body.tool_choice!r} cannot be combined with {constraint_field(body)}",
                           param="tool_choice")
        params.structured_outputs = constraint
    parser = PARSERS[state.tool_call_parser]() if mode == "auto" else None
    return ToolSetup(mode, name, parser, body.tools if functions else None)


@dataclasses.dataclass(frozen=True)
class ToolSetup:
    mode: str  # none, auto, required or named
    name: str | None  # the named function
    parser: object | None  # auto's parser
    tools: list | None  # for the chat template

    def message(self, completion) -> tuple[dict, str | None]:
        """The assistant message of a finished choice, and its finish_reason."""
        if self.mode in ("required", "named"):
            calls = constrained_calls(self.mode, self.name, completion.text)
            content = None if calls else completion.text
        elif self.mode == "auto":
            content, calls = self.parser.parse(completion.text)
        else:
            return {"role": "assistant", "content": completion.text}, completion.finish_reason
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.as_dict() for call in calls]
            return message, "tool_calls"
        return message, completion.finish_reason


@counted("chat_completions")
async def chat_completions(body: ChatCompletionRequest, raw: Request, state: State):
    """POST /v1/chat/completions"""
    check_model(state, body.model)
    refuse_unimplemented(body)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = sampling_params(state, body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    user_constraint = params.structured_outputs is not None
    tools = tool_setup(state, body, params)
    await compile_constraint(state, params, constraint_field(body) if user_constraint else "tools")
    served_model_name = state.served_model_name
    ids = await chat_token_ids(state, message_dicts(body.messages), body.chat_template, body.add_generation_prompt,
                               tools.tools)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    admit(state, raw, len(ids))
    try:
        streams = await submit_all(state, [(None, ids)], params, request_id, key_name(raw))
    except APIError as err:
        err.param = "messages" if err.param and err.param.startswith("prompt") else err.param
        raise
    k = body.top_logprobs or 0

    if not body.stream:
        (output,) = await run_to_completion(streams, raw)
        choices = []
        for c in output.outputs:
            message, finish_reason = tools.message(c)
            choices.append({"index": c.index, "message": message,
                            "logprobs": chat_logprobs(c, 0, len(c.token_ids), k) if body.logprobs else None,
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": served_model_name, "choices": choices, "usage": usage([output])}

    async def events():
        tracker = _Choices(params)
        tool_streams = {i: ToolCallStream(tools.mode, tools.name, tools.parser) for i in range(params.n)}
        include_usage = body.include_usage_in_stream()
        base = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": served_model_name}
        extra = {"usage": None} if include_usage else {}
        for index in range(params.n):
            yield _sse({**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}], **extra})
        final = None
        done: set[int] = set()
        async for _, output in merged(streams):
            for c in output.outputs:
                if c.index in done:
                    continue
                finished = c.finish_reason is not None
                sent = tracker.sent_text.get(c.index, 0)
                text, start, end = tracker.delta(c.index, c, finished)
                finish_reason = c.finish_reason
                if tools.mode == "none":
                    if text or start != end:
                        yield _sse({**base, "choices": [{
                            "index": c.index, "delta": {"content": text},
                            "logprobs": chat_logprobs(c, start, end, k) if body.logprobs else None,
                            "finish_reason": None}], **extra})
                else:
                    stream = tool_streams[c.index]
                    for delta in stream.deltas(c.text, sent + len(text), finished):
                        yield _sse({**base, "choices": [{"index": c.index, "delta": delta, "logprobs": None,
                                                         "finish_reason": None}], **extra})
                    if finished and stream.calls:
                        finish_reason = "tool_calls"
                if finished:
                    done.add(c.index)
                    yield _sse({**base, "choices": [{"index": c.index, "delta": {}, "logprobs": None,
                                                     "finish_reason": finish_reason,
                                                     "stop_reason": c.stop_reason}], **extra})
            final = output
        if include_usage:
            yield _sse({**base, "choices": [], "usage": usage([final])})
        yield _sse("[DONE]")

    return EventStream(events())


# ---- everything else ------------------------------------------------------------------------------


async def models(state: State):
    """GET /v1/models"""
    name = state.served_model_name
    return {"object": "list", "data": [{"id": name, "object": "model", "created": state.created,
                                        "owned_by": "paged", "root": state.model_path or name,
                                        "max_model_len": state.max_model_len}]}


async def health(state: State):
    """GET /health: 200 with an empty body while the engine runs, else 503."""
    if not state.engine.alive:
        return error_response(APIError(503, "the engine is not running", type_="server_error"))
    return Response(status_code=200)


async def tokenize(body: TokenizeRequest, state: State):
    """POST /tokenize"""
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "pass exactly one of prompt or messages", param="prompt")
    if body.prompt is not None:
        try:
            ids = await state.in_worker(_tokenize_text, state, body.prompt, body.add_special_tokens)
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt") from None
    else:
        ids = await chat_token_ids(state, message_dicts(body.messages), None, body.add_generation_prompt)
    return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}


async def detokenize(body: DetokenizeRequest, state: State):
    """POST /detokenize"""
    check_model(state, body.model)
    vocab = state.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": state.tokenizer.decode(body.tokens)}


async def prometheus_metrics(state: State):
    """GET /metrics: Prometheus text format."""
    metrics = state.metrics
    if metrics is None:
        return Response(b"", media_type="text/plain; version=0.0.4; charset=utf-8")
    for replica in state.engine.replicas:  # gauges as of now, not as of the last step
        with contextlib.suppress(EngineDeadError):
            await replica.call(metrics.update_gauges)
            await replica.call(metrics.update_device_memory)
    body = metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


# ---- the app ------------------------------------------------------------------------------------------


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
                                        f"(got {first.get('input')!r})"[:500], param=loc[0] if loc else None))


async def _http_error(request: Request, exc: StarletteHTTPException):
    """Starlette's own errors (unknown route 404, wrong method 405 with its Allow header, an unreadable body
    400, a body over the limit 413) in OpenAI's shape."""
    _count_refused(request, "invalid")
    response = error_response(APIError(exc.status_code, str(exc.detail)))
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
OPEN_ROUTES = ("/health", "/metrics", "/openapi.json")
GENERATION_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}


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
    (404, "unknown model"), (413, "request body over the server's limit"),
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
    ("/v1/models", models, ["GET"], {"model": ModelList, "description": "the served model"}),
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
              limits: ServerLimits = ServerLimits(), tool_call_parser: str | None = None) -> FastAPI:
    """The app starts the engine thread on startup and stops it (aborting what is left) on shutdown.

    `api_keys`: none, an open server; otherwise every route but OPEN_ROUTES needs one of them, and each key's
    limits apply to its generation requests (token limits need `metrics`, which sees the tokens generated)."""
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
        yield
        engine.stop()

    app = FastAPI(title="paged", version="0.1.0", lifespan=lifespan)
    app.state.paged = ServerState(engine, served_model_name, metrics, keys, model_path, limits, tool_call_parser)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    app.add_middleware(BearerAuth, keys=keys, metrics=metrics)
    app.add_middleware(BodyLimit, max_bytes=limits.max_request_body_bytes)  # outermost: before auth reads it
    for path, handler, methods, success in ROUTES:
        app.add_api_route(path, handler, methods=methods, response_model=None,
                          responses={200: success, **_JSON_ERRORS})
    app.openapi = lambda: _openapi(app)
    return app
