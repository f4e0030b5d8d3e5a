"""The pooling routes: POST /v1/embeddings (OpenAI's shape), /pooling, /classify, /score (/v1/score) and
/rerank (/v1/rerank, /v2/rerank), as vLLM serves them. Each input is one request to the engine, pooled whole
in one step; replies are built and encoded off the event loop."""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np
from fastapi import Request

from paged import PoolingParams
from paged.scoring import cosine, pair_encoding, score_pairs
from paged.serving.errors import APIError
from paged.serving.generation import (CLASSIFIER_ROUTES_HINT, EMBEDDING_ROUTES_HINT, GENERATION_ROUTES_HINT, admit,
                                      chat_token_ids, check_model, counted, run_to_completion, submit_all,
                                      tokenize_prompts)
from paged.serving.json_body import json_reply
from paged.serving.pooling_protocol import (ClassificationRequest, EmbeddingRequest, PromptInput, RerankRequest,
                                            ScoreRequest)
from paged.serving.state import ServerState, State, key_name

def _check_pooling(state: ServerState, route: str, task: str) -> None:
    """A pooling route needs a pooling model of its kind: a 400 naming the routes to use otherwise."""
    engine = state.engine
    name = state.served_model_name
    if engine.runner_type != "pooling":
        raise APIError(400, f"{route} needs a pooling model, and {name!r} generates text: use "
                            f"{GENERATION_ROUTES_HINT} (or serve it with --runner pooling to embed with it)",
                       code="wrong_model_type")
    if task == "embed" and engine.pooling_task != "embed":
        raise APIError(400, f"{route} returns embeddings, and {name!r} is a classifier: use {CLASSIFIER_ROUTES_HINT}",
                       code="wrong_model_type")
    if task == "classify" and engine.pooling_task != "classify":
        raise APIError(400, f"{route} needs a classifier, and {name!r} is an embedding model: use "
                            f"{EMBEDDING_ROUTES_HINT}", code="wrong_model_type")
    if task == "score" and engine.pooling_task == "classify" and len(state.engine.model_config.labels) != 1:
        raise APIError(400, f"{route} scores with a classifier of one label (a cross-encoder); {name!r} has "
                            f"{len(state.engine.model_config.labels)}: use /classify", code="wrong_model_type")


def _inputs(state: ServerState, value: PromptInput, field: str) -> list[tuple[str | None, list[int] | None]]:
    """The (text, token ids) of each input: one text or token list, or a batch of them."""
    if isinstance(value, str):
        return [(value, None)]
    if not value:
        raise APIError(400, f"{field} must not be empty", param=field)
    if isinstance(value[0], int):
        return [(None, list(value))]
    if len(value) > state.limits.max_prompts_per_request:
        raise APIError(400, f"a request may hold at most {state.limits.max_prompts_per_request} inputs "
                            f"(--max-prompts-per-request), got {len(value)}", param=field)
    return [(item, None) if isinstance(item, str) else (None, list(item)) for item in value]


async def _pool(state: ServerState, raw: Request, prompts: list, params: PoolingParams, prefix: str,
                token_types: list | None = None) -> tuple[list, int]:
    """Runs every prompt through the engine; (their PoolingRequestOutputs in order, prompt tokens)."""
    prompts = await tokenize_prompts(state, prompts)
    tokens = sum(len(ids) for _, ids in prompts)
    admit(state, raw, tokens)
    streams = await submit_all(state, prompts, params, f"{prefix}-{uuid.uuid4().hex}", key_name(raw), raw=raw,
                               token_types=token_types)
    return await run_to_completion(streams, raw), tokens


def _usage(tokens: int) -> dict:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def _vector(data: np.ndarray, encoding_format: str):
    """float32 values as a list, or base64 of their little-endian bytes (what OpenAI's clients decode)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(data, "<f4").tobytes()).decode("ascii")
    return data.tolist()


def _listing(state: ServerState, prefix: str, data: list, tokens: int) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": state.served_model_name, "data": data, "usage": _usage(tokens)}


async def _embedding_inputs(state: ServerState, body: EmbeddingRequest) -> list:
    if body.messages is None:
        return _inputs(state, body.input, "input")
    return [(None, await chat_token_ids(state, body.messages, None, body.add_generation_prompt))]


async def _vectors(body: EmbeddingRequest, raw: Request, state: ServerState, route: str, task: str, prefix: str,
                   kind: str, field: str):
    """An embeddings-shaped reply: one `kind` object per input, its vector under `field`."""
    check_model(state, body.model)
    _check_pooling(state, route, task)
    outputs, tokens = await _pool(state, raw, await _embedding_inputs(state, body),
                                  body.pooling_params(task, body.dimensions), prefix)
    return await json_reply(state, lambda: _listing(state, prefix, [
        {"object": kind, "index": i, field: _vector(o.outputs.data, body.encoding_format)}
        for i, o in enumerate(outputs)], tokens))


@counted("embeddings")
async def embeddings(body: EmbeddingRequest, raw: Request, state: State):
    """POST /v1/embeddings"""
    return await _vectors(body, raw, state, "/v1/embeddings", "embed", "embd", "embedding", "embedding")


@counted("pooling")
async def pooling(body: EmbeddingRequest, raw: Request, state: State):
    """POST /pooling: the model's pooled vector per input (an embedding, or a classifier's scores)."""
    return await _vectors(body, raw, state, "/pooling", "encode", "pool", "pooling", "data")


@counted("classify")
async def classify(body: ClassificationRequest, raw: Request, state: State):
    """POST /classify: each input's label probabilities and its most likely label."""
    check_model(state, body.model)
    _check_pooling(state, "/classify", "classify")
    outputs, tokens = await _pool(state, raw, _inputs(state, body.input, "input"), body.pooling_params("classify"),
                                  "classify")
    labels = state.engine.model_config.labels

    def item(i, output):
        probs = output.outputs.data
        return {"index": i, "label": labels[int(np.argmax(probs))], "probs": probs.tolist(),
                "num_classes": len(probs)}

    return await json_reply(state, lambda: _listing(state, "classify", [item(i, o) for i, o in enumerate(outputs)],
                                                    tokens))


async def _scores(state: ServerState, raw: Request, body, first, second, route: str) -> tuple[list[float], int]:
    """Relevance of each (first, second) pair: a cross-encoder's score of the pair read as one input, or the
    cosine similarity of an embedding model's two vectors."""
    _check_pooling(state, route, "score")
    try:
        pairs = score_pairs(first, second)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    if len(pairs) > state.limits.max_prompts_per_request:
        raise APIError(400, f"a request may score at most {state.limits.max_prompts_per_request} pairs "
                            f"(--max-prompts-per-request), got {len(pairs)}")
    engine = state.engine
    if engine.pooling_task == "classify":
        if state.tokenizer is None:
            raise APIError(400, "this server has no tokenizer to encode text pairs")
        try:
            encoded = await state.in_worker(lambda: [pair_encoding(state.tokenizer, a, b) for a, b in pairs])
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        outputs, tokens = await _pool(state, raw, [(None, e["input_ids"]) for e in encoded],
                                      body.pooling_params("score"), "score",
                                      [e.get("token_type_ids") for e in encoded])
        return [float(o.outputs.data[0]) for o in outputs], tokens
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    outputs, tokens = await _pool(state, raw, [(t, None) for t in texts], body.pooling_params("embed"), "score")
    vectors = {text: o.outputs.data for text, o in zip(texts, outputs)}
    return [cosine(vectors[a], vectors[b]) for a, b in pairs], tokens


@counted("score")
async def score(body: ScoreRequest, raw: Request, state: State):
    """POST /score (and /v1/score)"""
    check_model(state, body.model)
    scores, tokens = await _scores(state, raw, body, *body.sides(), route="/score")
    return await json_reply(state, lambda: _listing(state, "score", [
        {"index": i, "object": "score", "score": s} for i, s in enumerate(scores)], tokens))


@counted("rerank")
async def rerank(body: RerankRequest, raw: Request, state: State):
    """POST /rerank, /v1/rerank, /v2/rerank: the documents by relevance to the query, best first."""
    check_model(state, body.model)
    if not body.documents:
        raise APIError(400, "documents must not be empty", param="documents")
    scores, tokens = await _scores(state, raw, body, body.query, body.documents, route="/rerank")
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or None]

    def result(i):
        item = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            item["document"] = {"text": body.documents[i]}
        return item

    return await json_reply(state, lambda: {"id": f"rerank-{uuid.uuid4().hex}", "model": state.served_model_name,
                                            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                                            "results": [result(i) for i in ranked]})
