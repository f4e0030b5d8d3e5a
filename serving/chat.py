"""POST /v1/chat/completions, with tool calls."""

from __future__ import annotations

import dataclasses
import time
import uuid

from fastapi import Request

from paged import SamplingParams
from paged.serving.errors import APIError
from paged.serving.generation import (admit, chat_token_ids, check_generating, check_model, check_options, check_reply_size,
                                      check_room, compile_constraint, constraint_field, counted, prompt_tail,
                                      refuse_unimplemented, run_to_completion, sampling_params, submit_all, usage)
from paged.serving.json_body import json_reply
from paged.serving.logprobs import chat_logprobs, prompt_logprobs_json
from paged.serving.protocol import ChatCompletionRequest, message_dicts, non_text_part
from paged.reasoning import ReasoningStream, prepare_reasoning
from paged.serving.sse import EventStream, StreamedChoices, merged, sse
from paged.serving.state import ServerState, State, key_name
from paged.serving.tool_calls import (PARSERS, ToolCallStream, constrained_calls, functions_of, tool_choice_mode,
                                      tool_constraint)


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

    def message(self, completion, text: str | None = None) -> tuple[dict, str | None]:
        """The assistant message of a finished choice, and its finish_reason. `text`: the answer, where it is
        not the whole output (a reasoning parser took the thinking out)."""
        text = completion.text if text is None else text
        if self.mode in ("required", "named"):
            calls = constrained_calls(self.mode, self.name, text)
            content = None if calls else text
        elif self.mode == "auto":
            content, calls = self.parser.parse(text)
        else:
            return {"role": "assistant", "content": text}, completion.finish_reason
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.as_dict() for call in calls]
            # Cut short by max_tokens, the calls are partial: "length" says so.
            return message, "length" if completion.finish_reason == "length" else "tool_calls"
        return message, completion.finish_reason


@counted("chat_completions")
async def chat_completions(body: ChatCompletionRequest, raw: Request, state: State):
    """POST /v1/chat/completions"""
    adapter = check_model(state, body.model)
    check_generating(state, "/v1/chat/completions")
    refuse_unimplemented(body)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    check_options(state, body, body.top_logprobs, "top_logprobs")
    if (part := non_text_part(body.messages)) is not None:
        raise APIError(400, f"{state.served_model_name} is not a multimodal model: it reads text only, and a "
                            f"message holds a {part!r} content part", param="messages")
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                             body.prompt_logprobs)
    user_constraint = params.structured_outputs is not None
    tools = tool_setup(state, body, params)
    await compile_constraint(state, params, constraint_field(body) if user_constraint else "tools")
    served_model_name = adapter.lora_name if adapter is not None else state.served_model_name
    ids = await chat_token_ids(state, message_dicts(body.messages), body.chat_template, body.add_generation_prompt,
                               tools.tools)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    reasoning, inside = prepare_reasoning(state.reasoning_parser, await prompt_tail(state, ids), params)
    check_room(state, [(None, ids)], max_tokens,
               "max_completion_tokens" if body.max_completion_tokens else "max_tokens")
    check_reply_size(state, body, [(None, ids)], max_tokens, params.logprobs, body.prompt_logprobs,
                     "top_logprobs")
    admit(state, raw, len(ids))
    try:
        streams = await submit_all(state, [(None, ids)], params, request_id, key_name(raw), body.cache_salt, raw,
                                   lora_request=adapter)
    except APIError as err:
        err.param = "messages" if err.param and err.param.startswith("prompt") else err.param
        raise
    k = body.top_logprobs or 0

    if not body.stream:
        (output,) = await run_to_completion(streams, raw)

        def reply() -> dict:  # in a worker (serving/json_body.py)
            choices = []
            for c in output.outputs:
                split = reasoning.split(c.text, inside, final=True) if reasoning is not None else None
                message, finish_reason = tools.message(c, split.content if split is not None else None)
                if split is not None and split.reasoning is not None:
                    message["reasoning_content"] = split.reasoning
                    message["content"] = message["content"] or None  # the thinking alone: no answer yet
                choices.append({"index": c.index, "message": message,
                                "logprobs": chat_logprobs(c, 0, len(c.token_ids), k) if body.logprobs else None,
                                "finish_reason": finish_reason, "stop_reason": c.stop_reason})
            response = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                        "model": served_model_name, "choices": choices, "usage": usage([output])}
            if body.prompt_logprobs is not None:
                response["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
            return response

        return await json_reply(state, reply)

    async def events():
        tracker = StreamedChoices(params)
        tool_streams = {i: ToolCallStream(tools.mode, tools.name, tools.parser) for i in range(params.n)}
        thinking = {i: ReasoningStream(reasoning, inside) for i in range(params.n)} if reasoning else {}
        include_usage = body.include_usage_in_stream()
        base = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": served_model_name}
        extra = {"usage": None} if include_usage else {}
        for index in range(params.n):
            yield sse({**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
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
                answer, answer_ready = c.text, sent + len(text)  # the answer so far; how much of it may go
                if reasoning is not None:  # the thinking goes out as reasoning_content, the rest as the answer
                    thought, text = thinking[c.index].delta(c.text[:sent + len(text)], finished)
                    answer = thinking[c.index].answer
                    answer_ready = len(answer)
                    if thought:
                        yield sse({**base, "choices": [{
                            "index": c.index, "delta": {"reasoning_content": thought},
                            "logprobs": chat_logprobs(c, start, end, k) if body.logprobs else None,
                            "finish_reason": None}], **extra})
                        start = end  # these tokens' logprobs went with the thinking
                if tools.mode == "none":
                    if text or start != end:
                        yield sse({**base, "choices": [{
                            "index": c.index, "delta": {"content": text},
                            "logprobs": chat_logprobs(c, start, end, k) if body.logprobs else None,
                            "finish_reason": None}], **extra})
                else:
                    stream = tool_streams[c.index]
                    for delta in stream.deltas(answer, answer_ready, finished):
                        yield sse({**base, "choices": [{"index": c.index, "delta": delta, "logprobs": None,
                                                         "finish_reason": None}], **extra})
                    if finished and stream.calls and finish_reason != "length":
                        finish_reason = "tool_calls"
                if finished:
                    done.add(c.index)
                    yield sse({**base, "choices": [{"index": c.index, "delta": {}, "logprobs": None,
                                                     "finish_reason": finish_reason,
                                                     "stop_reason": c.stop_reason}], **extra})
            final = output
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage([final])})
        yield sse("[DONE]")

    return EventStream(events())
