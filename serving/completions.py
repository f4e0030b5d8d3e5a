"""POST /v1/completions"""

from __future__ import annotations

import time
import uuid

from fastapi import Request

from paged import RequestOutput
from paged.serving.errors import APIError
from paged.serving.generation import (admit, check_model, compile_constraint, constraint_field, counted,
                                      refuse_unimplemented, run_to_completion, sampling_params, submit_all,
                                      tokenize_prompts, usage)
from paged.serving.logprobs import completion_logprobs
from paged.serving.protocol import CompletionRequest
from paged.serving.sse import EventStream, StreamedChoices, merged, sse
from paged.serving.state import State, key_name


@counted("completions")
async def completions(body: CompletionRequest, raw: Request, state: State):
    """POST /v1/completions"""
    check_model(state, body.model)
    refuse_unimplemented(body)
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported", param="echo")
    params = sampling_params(body, body.max_tokens, body.logprobs)
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
        tracker = StreamedChoices(params)
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
                yield sse(chunk)
            if output.finished:
                finals[i] = output
        if include_usage:
            yield sse({"id": request_id, "object": "text_completion", "created": int(time.time()),
                        "model": served_model_name, "choices": [], "usage": usage(list(finals.values()))})
        yield sse("[DONE]")

    return EventStream(events())
