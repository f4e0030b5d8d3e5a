"""POST /v1/completions"""

from __future__ import annotations

import time
import uuid

from fastapi import Request

from paged import RequestOutput
from paged.serving.errors import APIError
from paged.serving.generation import (admit, check_generating, check_model, check_options, check_reply_size, check_room,
                                      compile_constraint, constraint_field, counted, refuse_unimplemented, run_to_completion,
                                      sampling_params, submit_all, tokenize_prompts, usage)
from paged.serving.json_body import json_reply
from paged.serving.logprobs import completion_logprobs, joined, prompt_logprobs_json
from paged.serving.protocol import CompletionRequest
from paged.serving.sse import EventStream, StreamedChoices, merged, sse
from paged.serving.state import State, key_name


@counted("completions")
async def completions(body: CompletionRequest, raw: Request, state: State):
    """POST /v1/completions"""
    adapter = check_model(state, body.model)
    check_generating(state, "/v1/completions")
    refuse_unimplemented(body)
    check_options(state, body, body.logprobs, "logprobs")
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens must be at least 1, got 0.", param="max_tokens")
    # echo with max_tokens 0 returns the prompt alone (what lm-eval's loglikelihood asks for): one token is
    # generated, as vLLM does, and not shown.
    echo_only = body.echo and body.max_tokens == 0
    max_tokens = 1 if echo_only else body.max_tokens
    # echo with logprobs: the prompt's tokens come with their logprobs too (null for the first).
    prompt_k = body.prompt_logprobs if body.prompt_logprobs is not None else body.logprobs if body.echo else None
    params = sampling_params(body, max_tokens, body.logprobs, prompt_k)
    await compile_constraint(state, params, constraint_field(body))
    tokenizer = state.tokenizer
    served_model_name = adapter.lora_name if adapter is not None else state.served_model_name
    prompt = body.prompt
    batched = not isinstance(prompt, str) and bool(prompt) and not isinstance(prompt[0], int)
    if batched and len(prompt) > state.limits.max_prompts_per_request:  # counted before anything is copied
        raise APIError(400, f"a request may hold at most {state.limits.max_prompts_per_request} prompts "
                       f"(--max-prompts-per-request), got {len(prompt)}", param="prompt")
    if isinstance(prompt, str):
        prompts = [(prompt, None)]
    elif prompt and isinstance(prompt[0], int):  # validated as one of the four shapes: the first tells which
        prompts = [(None, list(prompt))]
    elif prompt:
        prompts = [(p, None) if isinstance(p, str) else (None, list(p)) for p in prompt]
    else:
        raise APIError(400, "prompt must not be empty", param="prompt")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    prompts = await tokenize_prompts(state, prompts)
    check_room(state, prompts, max_tokens, "max_tokens")
    check_reply_size(state, body, prompts, max_tokens, body.logprobs, prompt_k, "logprobs", prompt_copies=body.n)
    admit(state, raw, sum(len(ids) for _, ids in prompts))
    streams = await submit_all(state, prompts, params, request_id, key_name(raw), body.cache_salt, raw,
                               lora_request=adapter)
    n = params.n
    decode = lambda token: tokenizer.decode([token]) if tokenizer is not None else ""

    def prompt_text(output):
        return output.prompt if output.prompt is not None else tokenizer.decode(output.prompt_token_ids)

    def choice(i, output, c, text, start, end, finished, offset, opening):
        """One choice (or its chunk): `text` and the generated tokens [start, end), whose text begins at
        `offset` in the choice's; `opening`: the choice's first chunk, which carries the prompt's logprobs and
        the echoed prompt (its text is in `text` already)."""
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(c.token_ids[start:end], c.logprobs[start:end], body.logprobs, offset,
                                           decode)
            if opening and body.echo:
                logprobs = joined(completion_logprobs(output.prompt_token_ids, output.prompt_logprobs,
                                                      body.logprobs, 0, decode), logprobs)
        item = {"index": i * n + c.index, "text": text, "logprobs": logprobs,
                "finish_reason": c.finish_reason if finished else None,
                "stop_reason": c.stop_reason if finished else None}
        if body.prompt_logprobs is not None:
            item["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs) if opening else None
        return item

    if not body.stream:
        outputs = await run_to_completion(streams, raw)

        def reply() -> dict:  # in a worker (serving/json_body.py)
            choices = []
            for i, o in enumerate(outputs):
                echoed = prompt_text(o) if body.echo else ""
                for c in o.outputs:
                    shown = 0 if echo_only else len(c.token_ids)
                    choices.append(choice(i, o, c, echoed + ("" if echo_only else c.text), 0, shown, True,
                                          len(echoed), True))
            return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                    "model": served_model_name, "choices": choices, "usage": usage(outputs)}

        return await json_reply(state, reply)

    async def events():
        tracker = StreamedChoices(params)
        finals: dict[int, RequestOutput] = {}
        offsets: dict = {}  # where each choice's next token starts in its text (logprobs' text_offset)
        done: set = set()
        include_usage = body.include_usage_in_stream()
        async for i, output in merged(streams):
            for c in output.outputs:
                key = (i, c.index)
                if key in done:
                    continue  # a finished sample of an n > 1 request keeps appearing in later outputs
                finished = c.finish_reason is not None
                text, start, end = tracker.delta(key, c, finished)
                if echo_only:
                    text, start, end = "", 0, 0
                first = key not in offsets
                if first:
                    offsets[key] = len(prompt_text(output)) if body.echo else 0
                    if body.echo:
                        text = prompt_text(output) + text
                if finished:
                    done.add(key)
                elif not text and start == end:
                    continue
                item = choice(i, output, c, text, start, end, finished, offsets[key], first)
                if item["logprobs"] is not None and item["logprobs"]["tokens"]:
                    offsets[key] = item["logprobs"]["text_offset"][-1] + len(item["logprobs"]["tokens"][-1])
                chunk = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                         "model": served_model_name, "choices": [item]}
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
