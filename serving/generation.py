"""What the generation routes share: model and field checks, sampling parameters, tokenizing off the event
loop, admission under the key's limits, submitting, waiting, and counting each request once."""

from __future__ import annotations

import asyncio
import functools
import logging
import math

from fastapi import Request
from fastapi.responses import Response

from paged import InvalidParameter, LoRARequest, InvalidStructuredOutput, PoolingParams, RequestOutput, SamplingParams
from paged.chat import chat_prompt_token_ids, text_token_ids
from paged.serving.api_keys import ANONYMOUS, RateLimited
from paged.serving.async_engine import EngineDeadError, QueueFullError, RequestFailedError, RequestStream
from paged.serving.errors import APIError, api_error_of, outcome_of
from paged.serving.sse import EventStream
from paged.serving.state import ServerState, State, key_name

logger = logging.getLogger("paged.serve")


class ClientDisconnected(Exception):
    """The client of a non-streamed request closed its connection before the reply."""


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
            except ClientDisconnected:
                count("aborted")
                logger.info("%s %s: the client left before the reply; its requests were aborted", raw.method,
                            raw.url.path)
                return Response(status_code=499)  # nginx's "client closed request": nobody reads it
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


def check_model(state: ServerState, model: str | None) -> LoRARequest | None:
    """The LoRA adapter `model` names (None: the base model); a 404 for a model this server does not serve."""
    if model is not None and model in state.lora_adapters:
        return state.lora_adapters[model]
    if model is not None and model not in state.model_names:
        # repr: the name as the client sent it, escaped (a control character or a lone surrogate stays inert)
        adapters = f" and the LoRA adapters {sorted(state.lora_adapters)}" if state.lora_adapters else ""
        raise APIError(404, f"the model {model[:200]!r} does not exist; this server serves "
                            f"{state.served_model_name!r}{adapters[:1000]}",
                       param="model", code="model_not_found")
    return None


GENERATION_ROUTES_HINT = "/v1/completions, /v1/chat/completions or /v1/responses"
EMBEDDING_ROUTES_HINT = "/v1/embeddings, /pooling, /score or /rerank"
CLASSIFIER_ROUTES_HINT = "/classify, /score or /rerank"


def pooling_routes_hint(engine) -> str:
    """The routes a pooling model serves, for the 400 that refuses a generation route."""
    return CLASSIFIER_ROUTES_HINT if engine.pooling_task == "classify" else EMBEDDING_ROUTES_HINT


def check_generating(state: ServerState, route: str) -> None:
    """A generation route on a pooling model is a 400 naming the routes it serves."""
    engine = state.engine
    if engine.runner_type == "pooling":
        raise APIError(400, f"{route} generates text, and the model {state.served_model_name!r} is a pooling model "
                            f"({engine.pooling_task}): use {pooling_routes_hint(engine)}", code="wrong_model_type")


def refuse_unimplemented(body) -> None:
    """A field that would change what the request means, which this server does not implement yet, is a
    400 naming it: never a 200 with output that ignored it."""
    field = body.unimplemented_field()
    if field is not None:
        raise APIError(400, f"{field} is not supported by this server yet", param=field,
                       code="unsupported_parameter")


def check_options(state: ServerState, body, logprobs: int | None, logprobs_field: str) -> None:
    """vLLM's 400s for options both routes share: stream_options without stream, logprobs over the server's
    --max-logprobs, prompt logprobs on a stream (they would arrive only after the whole prompt anyway)."""
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
    limit = state.limits.max_logprobs
    for field, kind, value in ((logprobs_field, "sample", logprobs), ("prompt_logprobs", "prompt", body.prompt_logprobs)):
        if value is not None and value > limit:
            raise APIError(400, f"Requested {kind} logprobs of {value}, which is greater than max allowed: {limit}",
                           param=field)
    if body.prompt_logprobs and body.stream:
        raise APIError(400, "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")


def check_room(state: ServerState, prompts: list[tuple[str | None, list[int]]], max_tokens: int | None,
               field: str) -> None:
    """A 400 naming `field` when a prompt leaves less room in max_model_len than max_tokens asks for (a prompt
    that does not fit at all is refused by the engine, naming the prompt)."""
    if max_tokens is None:
        return
    longest = max(len(ids) for _, ids in prompts)
    limit = state.max_model_len
    if longest < limit < longest + max_tokens:
        raise APIError(400, f"This model's maximum context length is {limit} tokens (max_model_len). However, you "
                            f"requested {longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for "
                            f"the completion). Please reduce the length of the prompt or {field}.", param=field)


def check_reply_size(state: ServerState, body, prompts: list[tuple[str | None, list[int]]],
                     max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                     field: str, prompt_copies: int = 1) -> None:
    """A 400 naming `field` when a non-streamed reply could carry more logprob entries than
    --max-reply-logprobs: n x max tokens x (top logprobs + 1) per prompt, plus each prompt's own positions
    x (prompt logprobs + 1) x `prompt_copies` (completions repeat them in each of the n choices). A stream
    sends them a chunk at a time and is not bounded by this."""
    if body.stream or (logprobs is None and prompt_logprobs is None):
        return
    entries = 0
    for _, ids in prompts:
        room = state.max_model_len - len(ids)
        tokens = room if max_tokens is None else min(max_tokens, room)
        if logprobs is not None:
            entries += body.n * max(tokens, 0) * (logprobs + 1)
        if prompt_logprobs is not None:
            entries += len(ids) * (prompt_logprobs + 1) * prompt_copies
    limit = state.limits.max_reply_logprobs
    if entries > limit:
        raise APIError(400, f"this request's reply could carry {entries} logprob entries (n x max tokens x (top "
                            f"logprobs + 1), plus the prompt's), more than this server allows in a non-streamed "
                            f"reply ({limit}, --max-reply-logprobs): stream it, or ask for fewer", param=field)


def sampling_params(body, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The body's SamplingParams; what depends on the model (n against max_num_seqs, token ids against the
    vocabulary) the engine checks when the request is submitted (an InvalidParameter naming the field)."""
    try:
        return body.sampling_params(max_tokens, logprobs, prompt_logprobs)
    except InvalidStructuredOutput as exc:
        raise APIError(400, str(exc), param=exc.field.split(".")[0])
    except InvalidParameter as exc:
        raise APIError(400, str(exc), param=exc.field)
    except ValueError as exc:
        raise APIError(400, str(exc))


async def compile_constraint(state: ServerState, params: SamplingParams, field: str) -> None:
    """Compiles the request's grammar in a worker (the engine thread then finds it cached): a bad schema,
    regex or grammar is a 400 naming `field`, the request's field that holds it."""
    constraint = params.structured_outputs
    if constraint is None:
        return
    grammars = state.engine.grammars
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


def tokenize_text(state: ServerState, text: str, add_special_tokens: bool) -> list[int]:
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


async def prompt_tail(state: ServerState, ids: list[int], tokens: int = 16) -> str:
    """The text of a prompt's last tokens (whether a chat template left a <think> block open); "" without a
    reasoning parser, which is the only reader."""
    if state.reasoning_parser is None or state.tokenizer is None or not ids:
        return ""
    return await state.in_worker(state.tokenizer.decode, ids[-tokens:])


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
                ids = await state.in_worker(tokenize_text, state, text, True)
            except ValueError as exc:
                raise APIError(400, str(exc), param=_prompt_param(prompts, i)) from None
        out.append((text, ids))
    return out


# A batch's prompts are submitted one engine round trip each: between every this many, the connection is
# checked, so a client that leaves mid-submission stops the rest (and aborts what went in).
DISCONNECT_CHECK_EVERY = 32


async def submit_all(state: ServerState, prompts: list[tuple[str | None, list[int] | None]],
                     params: SamplingParams | PoolingParams, request_id: str, key: str = ANONYMOUS,
                     cache_salt: str | None = None, raw: Request | None = None,
                     token_types: list[list[int] | None] | None = None,
                     lora_request: LoRARequest | None = None) -> list[RequestStream]:
    """Submits every prompt; their generated tokens are counted (and charged) under API key `key`. With `raw`,
    a client that disconnects while a batch is being submitted ends it (ClientDisconnected, nothing left
    running). `token_types`: per prompt, a cross-encoder's pair segments (PoolingParams only); `lora_request`:
    the LoRA adapter the request named as its model (`check_model`)."""
    streams = []
    try:
        for i, (text, ids) in enumerate(prompts):
            if raw is not None and i and i % DISCONNECT_CHECK_EVERY == 0 and await raw.is_disconnected():
                for s in streams:
                    s.close()
                raise ClientDisconnected
            child_id = f"{request_id}-{i}"
            if state.metrics is not None:
                state.metrics.attribute(child_id, key)
            try:
                streams.append(await state.engine.submit(child_id, text, ids, params, cache_salt, tenant=key,
                                                         token_type_ids=token_types[i] if token_types else None,
                                                         lora_request=lora_request))
            except BaseException:
                if state.metrics is not None:
                    state.metrics.forget(child_id)  # refused: nothing of it is ever counted
                raise
    except ValueError as exc:
        for s in streams:
            s.close()
        param = exc.field if isinstance(exc, InvalidParameter) else _prompt_param(prompts, len(streams))
        raise APIError(400, str(exc), param=param)
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
            # Its cancellation is expected: retrieve it so asyncio does not report it as lost.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            raise ClientDisconnected  # closing the streams (below) aborts the requests
        return task.result()
    except (EngineDeadError, RequestFailedError) as exc:
        raise api_error_of(exc) from None
    finally:
        task.cancel()
        watcher.cancel()
        for s in streams:
            s.close()


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
