"""POST /v1/responses: OpenAI's Responses API over the chat path (template, sampling, structured outputs).

A response's `output` is a list of items: a reasoning item first when `--reasoning-parser` found thinking,
then the assistant message with one `output_text` part. A reply cut by max_output_tokens is `incomplete`
(`incomplete_details.reason: "max_output_tokens"`), as OpenAI reports it.

Streams follow the Responses event sequence, each event numbered: response.created, response.in_progress,
then per item output_item.added, (content_part.added, output_text.delta..., output_text.done,
content_part.done) or (reasoning_text.delta..., reasoning_text.done), output_item.done, and at the end
response.completed (or response.incomplete). A failure mid-stream is an `error` event.

Function tools go through chat's tool path (`required` and a named function constrained by a grammar, `auto`
parsed by the server's --tool-call-parser) and come back as `function_call` items; a later turn sends them
back with `function_call_output` items.

With `store` (the default) a finished response is kept (serving/response_store.py): `previous_response_id`
continues its conversation (its input and output items come before the new input; its instructions do not),
and `GET` / `DELETE /v1/responses/{id}` read and drop it. Not served yet, each a 400 naming the field: built-in
tools, conversation objects, background, include values but output-text logprobs, prompt templates, reasoning
settings, n > 1.
"""

from __future__ import annotations

import collections
import itertools
import json
import time
import uuid
from types import SimpleNamespace

from fastapi import Request

from paged.serving.chat import tool_setup
from paged.serving.errors import APIError
from paged.serving.generation import (admit, chat_token_ids, check_generating, check_model, check_options, check_reply_size,
                                      check_room, compile_constraint, counted, prompt_tail, run_to_completion,
                                      sampling_params, submit_all)
from paged.serving.json_body import json_reply
from paged.serving.logprobs import chat_logprobs
from paged.serving.protocol import ResponsesRequest
from paged.reasoning import END, ReasoningStream, prepare_reasoning
from paged.serving.sse import EventStream, StreamedChoices, merged
from paged.serving.tool_calls import ToolCallStream
from paged.serving.state import State, key_name


@counted("responses")
async def responses(body: ResponsesRequest, raw: Request, state: State):
    """POST /v1/responses"""
    adapter = check_model(state, body.model)
    check_generating(state, "/v1/responses")
    if (field := body.unimplemented_field()) is not None:
        raise APIError(400, f"{field} is not supported by this server's Responses API yet", param=field)
    earlier = _earlier_items(state, body, key_name(raw))
    try:
        messages = body.messages(earlier)
    except ValueError as exc:
        raise APIError(400, str(exc), param="input") from None
    check_options(state, body, body.top_logprobs, "top_logprobs")
    k = body.top_logprobs or 0
    params = sampling_params(body, body.max_output_tokens, k if body.wants_logprobs() else None)
    try:  # function tools go through chat's tool path, in chat's shape
        chat_tools = body.chat_tools()
    except ValueError as exc:
        raise APIError(400, str(exc), param="tools") from None
    try:
        chat_tool_choice = body.chat_tool_choice()
    except ValueError as exc:
        raise APIError(400, str(exc), param="tool_choice") from None
    chat_like = SimpleNamespace(tools=chat_tools, tool_choice=chat_tool_choice,
                                parallel_tool_calls=body.parallel_tool_calls, structured_outputs=body.structured_outputs)
    user_constraint = params.structured_outputs is not None
    tools = tool_setup(state, chat_like, params)
    await compile_constraint(state, params, ("text" if body.text else "response_format") if user_constraint
                             else "tools")
    ids = await chat_token_ids(state, messages, None, True, tools.tools)
    check_room(state, [(None, ids)], body.max_output_tokens, "max_output_tokens")
    check_reply_size(state, body, [(None, ids)], body.max_output_tokens, params.logprobs, None, "top_logprobs")
    reasoning, inside = prepare_reasoning(state.reasoning_parser, await prompt_tail(state, ids), params)
    admit(state, raw, len(ids))
    response_id = f"resp_{uuid.uuid4().hex}"
    try:
        streams = await submit_all(state, [(None, ids)], params, response_id, key_name(raw), body.cache_salt, raw,
                                   lora_request=adapter)
    except APIError as err:
        err.param = "input" if err.param and err.param.startswith("prompt") else err.param
        raise
    store = state.response_store if body.store and state.response_store.enabled else None
    shell = _Shell(response_id, adapter.lora_name if adapter is not None else state.served_model_name, body,
                   stored=store is not None)
    conversation = [*earlier, *body.input_items()]

    if not body.stream:
        (output,) = await run_to_completion(streams, raw)

        def reply() -> dict:
            (choice,) = output.outputs
            split = reasoning.split(choice.text, inside, final=True) if reasoning is not None else None
            items = []
            if split is not None and split.reasoning is not None:
                items.append(_reasoning_item(f"rs_{uuid.uuid4().hex}", split.reasoning, "completed"))
            logprobs = (_answer_logprobs(choice, split is not None and split.reasoning is not None, k)
                        if params.logprobs is not None else [])
            items += _answer_items(tools, choice, split.content if split else choice.text, logprobs)
            response = shell.response(_status(choice.finish_reason), items, _usage(output))
            if store is not None:
                store.put(response, conversation, key_name(raw))
            return response

        return await json_reply(state, reply)

    async def events():
        sequence = itertools.count()
        event = lambda kind, **fields: _event(kind, next(sequence), **fields)
        yield event("response.created", response=shell.response("in_progress", [], None))
        yield event("response.in_progress", response=shell.response("in_progress", [], None))
        tracker = StreamedChoices(params)
        thinking = ReasoningStream(reasoning, inside) if reasoning is not None else None
        items: list[dict] = []  # output items, as they open
        texts: dict[int, str] = {}  # output index -> its text so far
        logprobs: dict[int, list] = collections.defaultdict(list)  # output index -> its tokens' logprobs
        reasoning_index = message_index = None

        def open_item(item: dict) -> tuple[int, list[str]]:
            items.append(item)
            index = len(items) - 1
            texts[index] = ""
            opened = [event("response.output_item.added", output_index=index, item=item)]
            if item["type"] == "message":
                opened.append(event("response.content_part.added", item_id=item["id"], output_index=index,
                                    content_index=0, part=_text_part("")))
            return index, opened

        def close_item(index: int, status: str) -> list[str]:
            item, text = items[index], texts[index]
            if item["type"] == "reasoning":
                done = [event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=text)]
                items[index] = _reasoning_item(item["id"], text, status)
            else:
                done = [event("response.output_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=text, logprobs=logprobs[index]),
                        event("response.content_part.done", item_id=item["id"], output_index=index,
                              content_index=0, part=_text_part(text, logprobs[index]))]
                items[index] = _message_item(item["id"], text, status, logprobs[index])
            return [*done, event("response.output_item.done", output_index=index, item=items[index])]

        def whole_item(item: dict) -> list[str]:
            """A finished item's events: added (empty), its text or arguments as one delta, done."""
            status = item["status"]
            if item["type"] == "function_call":
                items.append(item)
                index = len(items) - 1
                return [event("response.output_item.added", output_index=index,
                              item={**item, "arguments": "", "status": "in_progress"}),
                        event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=item["arguments"]),
                        event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=item["arguments"], name=item["name"]),
                        event("response.output_item.done", output_index=index, item=item)]
            index, opened = open_item(_message_item(item["id"], "", "in_progress"))
            text = item["content"][0]["text"]
            texts[index] = text
            delta = [event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                           delta=text, logprobs=[])] if text else []
            return [*opened, *delta, *close_item(index, status)]

        call_stream = _StreamedCall(tools, items, event)
        final = None
        async for _, output in merged(streams):
            (choice,) = output.outputs
            finished = choice.finish_reason is not None
            sent = tracker.sent_text.get(0, 0)
            text, start, end = tracker.delta(0, choice, finished)
            thought = ""
            if thinking is not None:
                thought, text = thinking.delta(choice.text[:sent + len(text)], finished)
            # This chunk's tokens' logprobs go with its answer text (a chunk that holds thinking keeps them, as
            # chat's reasoning_content chunks do).
            chunk_logprobs = (chat_logprobs(choice, start, end, k)["content"]
                              if params.logprobs is not None and not thought else [])
            if thought:
                if reasoning_index is None:
                    reasoning_index, opened = open_item(_reasoning_item(f"rs_{uuid.uuid4().hex}", "", "in_progress"))
                    for e in opened:
                        yield e
                texts[reasoning_index] += thought
                yield event("response.reasoning_text.delta", item_id=items[reasoning_index]["id"],
                            output_index=reasoning_index, content_index=0, delta=thought)
            if tools.mode == "named":  # the answer is the call's arguments: they go out as they come
                answer = thinking.answer if thinking is not None else choice.text
                ready = len(answer) if thinking is not None else sent + len(text)
                if answer or finished:
                    if reasoning_index is not None and items[reasoning_index]["status"] == "in_progress":
                        for e in close_item(reasoning_index, "completed"):
                            yield e
                    for e in call_stream.events(answer, ready, finished, _status(choice.finish_reason)):
                        yield e
            elif tools.mode != "none":  # the answer may be calls: its items go out whole at the end
                answer = thinking.answer if thinking is not None else choice.text
                if finished:
                    if reasoning_index is not None:
                        for e in close_item(reasoning_index, "completed"):
                            yield e
                    for item in _answer_items(tools, choice, answer):
                        for e in whole_item(item):
                            yield e
            elif text or chunk_logprobs or (finished and message_index is None):
                if reasoning_index is not None and message_index is None:
                    for e in close_item(reasoning_index, "completed"):
                        yield e
                if message_index is None:
                    message_index, opened = open_item(_message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress"))
                    for e in opened:
                        yield e
                if text or chunk_logprobs:
                    texts[message_index] += text
                    logprobs[message_index] += chunk_logprobs
                    yield event("response.output_text.delta", item_id=items[message_index]["id"],
                                output_index=message_index, content_index=0, delta=text, logprobs=chunk_logprobs)
            final = output
        (choice,) = final.outputs
        status = _status(choice.finish_reason)
        for index in range(len(items)):
            if items[index]["status"] == "in_progress":
                for e in close_item(index, "completed" if status == "completed" else "incomplete"):
                    yield e
        kind = "response.completed" if status == "completed" else "response.incomplete"
        response = shell.response(status, items, _usage(final))
        if store is not None:
            await state.in_worker(store.put, response, conversation, key_name(raw))
        yield event(kind, response=response)

    stream = EventStream(events(), error_events=lambda err: [_event(
        "error", 0, message=err.message, code=err.code or err.type, param=err.param)])
    return stream


async def stored_response(response_id: str, raw: Request, state: State):
    """GET /v1/responses/{response_id}: a stored response; DELETE: drops it. A 404 once it is evicted, expired or
    deleted, and for another API key's."""
    key = key_name(raw)
    if raw.method == "DELETE" and state.response_store.delete(response_id, key):
        return {"id": response_id, "object": "response", "deleted": True}
    entry = state.response_store.get(response_id, key) if raw.method == "GET" else None
    if entry is None:
        raise APIError(404, f"Response with id {response_id!r} not found", param="response_id", code="not_found")
    return entry.response


def _earlier_items(state: State, body: ResponsesRequest, key: str) -> list[dict]:
    """The conversation `previous_response_id` continues: its input items, then its output items."""
    if body.previous_response_id is None:
        return []
    if not state.response_store.enabled:
        raise APIError(400, "previous_response_id needs stored responses, and this server keeps none "
                            "(--responses-store-mb 0)", param="previous_response_id")
    entry = state.response_store.get(body.previous_response_id, key)
    if entry is None:
        raise APIError(404, f"Previous response with id {body.previous_response_id!r} not found (never stored, "
                            "or evicted)", param="previous_response_id", code="previous_response_not_found")
    return [*entry.input_items, *entry.response["output"]]


def _answer_items(tools, choice, answer: str, logprobs: list[dict] = ()) -> list[dict]:
    """The answer's output items: the message, and with tools in play the function calls it made (auto may
    write text around them; a reply cut short keeps the calls written so far, as chat does). `logprobs`: the
    answer tokens' (with tools in play, the text is not all of them: none go out)."""
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    message, _ = tools.message(choice, answer)
    items = []
    if message.get("content") or not message.get("tool_calls"):
        items.append(_message_item(f"msg_{uuid.uuid4().hex}", message.get("content") or "", status,
                                   list(logprobs) if tools.mode == "none" else []))
    for call in message.get("tool_calls", []):
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": status})
    return items


class _StreamedCall:
    """A named function's call, streamed: output_item.added once the answer starts, its arguments as
    function_call_arguments.delta events as they are generated, and the done events at the end."""

    def __init__(self, tools, items: list[dict], event):
        self.deltas = ToolCallStream(tools.mode, tools.name, None)
        self.items, self.event, self.index = items, event, None

    def events(self, answer: str, ready: int, finished: bool, status: str) -> list[str]:
        out = []
        for delta in self.deltas.deltas(answer, ready, finished):
            (call,) = delta["tool_calls"]
            if "id" in call:
                self.items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                                   "name": call["function"]["name"], "arguments": "", "status": "in_progress"})
                self.index = len(self.items) - 1
                out.append(self.event("response.output_item.added", output_index=self.index,
                                      item=self.items[self.index]))
            elif call["function"]["arguments"]:
                item = self.items[self.index]
                item["arguments"] += call["function"]["arguments"]
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.index, delta=call["function"]["arguments"]))
        if finished:
            item = self.items[self.index]
            item["status"] = status
            out += [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=self.index,
                               arguments=item["arguments"], name=item["name"]),
                    self.event("response.output_item.done", output_index=self.index, item=item)]
        return out


def _answer_logprobs(choice, thought: bool, k: int) -> list[dict]:
    """The answer's tokens' logprobs in a whole reply: after `thought` (a reasoning item was split off), the
    tokens after the one that completes </think>."""
    first = 0
    if thought:
        pieces = ""
        first = len(choice.token_ids)
        for j, token in enumerate(choice.token_ids):
            pieces += choice.logprobs[j][token].decoded_token or ""
            if END in pieces:
                first = j + 1
                break
    return chat_logprobs(choice, first, len(choice.token_ids), k)["content"]


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _event(kind: str, sequence_number: int, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence_number, **fields})}\n\n"


def _text_part(text: str, logprobs: list[dict] = ()) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


def _message_item(item_id: str, text: str, status: str, logprobs: list[dict] = ()) -> dict:
    content = [_text_part(text, logprobs)] if status != "in_progress" else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []}


def _usage(output) -> dict:
    prompt = len(output.prompt_token_ids)
    generated = sum(len(c.token_ids) for c in output.outputs)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": output.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + generated}


class _Shell:
    """The response object around its output items: the request's settings echoed as OpenAI echoes them."""

    def __init__(self, response_id: str, model: str, body: ResponsesRequest, stored: bool):
        self.id, self.model, self.body, self.stored = response_id, model, body, stored
        self.created_at = int(time.time())

    def response(self, status: str, output: list[dict], usage: dict | None) -> dict:
        body = self.body
        fmt = (body.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": None, "store": self.stored,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p, "text": {"format": fmt},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "truncation": "disabled",
            "user": body.user,
        }
