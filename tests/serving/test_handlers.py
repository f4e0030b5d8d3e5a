"""Route handlers are plain functions over a ServerState: each can be called alone, without an app."""

from __future__ import annotations

import asyncio

import pytest

from paged.serving.chat import chat_completions
from paged.serving.errors import APIError
from paged.serving.server_info import health, models
from paged.serving.state import ServerState
from paged.serving.tokenization import detokenize
from paged.serving.protocol import ChatCompletionRequest, DetokenizeRequest


class _Engine:  # what the handlers read of an AsyncEngine (no model is loaded)
    alive = False
    tokenizer = None
    runner_type, pooling_task = "generate", None

    class config:
        max_model_len = 64

    class model_config:
        vocab_size = 10


def test_handlers_run_without_an_app():
    state = ServerState(_Engine(), "tiny", model_path="/models/tiny")
    listing = asyncio.run(models(state))
    assert listing["data"][0]["id"] == "tiny" and listing["data"][0]["max_model_len"] == 64
    assert asyncio.run(health(state)).status_code == 503  # the engine is not alive
    with pytest.raises(APIError) as caught:
        asyncio.run(detokenize(DetokenizeRequest(tokens=[3, 12]), state))
    assert caught.value.status == 400 and caught.value.param == "tokens"
    with pytest.raises(APIError) as caught:
        asyncio.run(chat_completions(ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                           functions=[{"name": "f"}]), None, state))
    assert caught.value.param == "functions"
    with pytest.raises(APIError) as caught:
        asyncio.run(models_named(state, "other"))
    assert caught.value.status == 404 and caught.value.param == "model"


async def models_named(state, model):
    from paged.serving.generation import check_model
    check_model(state, model)


def test_every_counted_outcome_is_documented():
    """`paged:api_requests{outcome}` takes only paged.serving.metrics.OUTCOMES (the dashboard charts those): the
    outcome of every error status, and every outcome the server names literally."""
    import ast
    import inspect

    from paged.serving import app, generation, sse
    from paged.serving.errors import outcome_of
    from paged.serving.metrics import OUTCOMES

    errors = [APIError(status, "x") for status in range(400, 600)]
    errors += [APIError(503, "x", code="overloaded"), APIError(429, "x", code="rate_limit_exceeded")]
    assert {outcome_of(err) for err in errors} <= set(OUTCOMES)
    literals = set()
    for node in (n for module in (app, generation, sse) for n in ast.walk(ast.parse(inspect.getsource(module)))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                "count", "count_request", "_count_refused"):
            literals |= {arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)}
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "outcome" for t in node.targets) \
                and isinstance(node.value, ast.Constant):
            literals.add(node.value.value)
    assert {"ok", "aborted", "failed", "unauthorized", "invalid"} <= literals  # the walk finds the call sites
    assert literals <= set(OUTCOMES), literals - set(OUTCOMES)
