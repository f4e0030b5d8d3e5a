"""POST /tokenize and /detokenize, as vLLM serves them."""

from __future__ import annotations

from paged.serving.errors import APIError
from paged.serving.generation import chat_token_ids, check_model, tokenize_text
from paged.serving.protocol import DetokenizeRequest, TokenizeRequest, message_dicts
from paged.serving.state import State


async def tokenize(body: TokenizeRequest, state: State):
    """POST /tokenize"""
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "pass exactly one of prompt or messages", param="prompt")
    if body.prompt is not None:
        try:
            ids = await state.in_worker(tokenize_text, state, body.prompt, body.add_special_tokens)
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
