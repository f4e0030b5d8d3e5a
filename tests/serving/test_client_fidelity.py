"""What third-party clients rely on, through the official `openai` client and raw HTTP: completions echo with
logprobs (lm-eval's loglikelihood request), vLLM's prompt_logprobs, strict JSON for constrained logprobs,
vLLM's 400s, /version, models.retrieve and unknown routes."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from paged import LLM, SamplingParams
from tests.serving.server_fixture import Server

FLAGS = ["--block-size", "8", "--max-model-len", "128", "--max-num-seqs", "8"]
PROMPT_IDS = [5, 17, 230, 41, 9, 77, 301, 12, 64, 8, 150]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server(tiny_model_dir, *FLAGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def engine_run(tiny_model_dir):
    """The same request through LLM.generate: prompt logprobs and two generated tokens' logprobs."""
    llm = LLM(tiny_model_dir, block_size=8, max_model_len=128, show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=3, prompt_logprobs=3, ignore_eos=True)
    return llm.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)[0]


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_echo_with_logprobs_and_no_new_tokens_is_the_prompts_loglikelihood(client, engine_run):
    """lm-eval's loglikelihood request: the prompt's tokens with their logprobs, the first one null."""
    out = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=0, echo=True, logprobs=1,
                                    temperature=0)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(PROMPT_IDS)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [engine_run.prompt_logprobs[j][t].logprob for j, t in enumerate(PROMPT_IDS) if j]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
    assert all(len(top) in (1, 2) for top in lp.top_logprobs[1:])  # the top one, and the prompt's if other
    assert choice.text == "".join(lp.tokens)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]


def test_echo_with_logprobs_puts_the_prompt_before_the_new_tokens(client, engine_run):
    args = dict(model="tiny", prompt=PROMPT_IDS, max_tokens=2, echo=True, logprobs=3, temperature=0,
                extra_body={"ignore_eos": True})
    out = client.completions.create(**args).choices[0]
    n = len(PROMPT_IDS)
    assert len(out.logprobs.tokens) == n + 2
    generated = engine_run.outputs[0]
    assert out.logprobs.token_logprobs[n:] == pytest.approx(
        [generated.logprobs[j][t].logprob for j, t in enumerate(generated.token_ids)], abs=1e-5)
    assert out.text == "".join(out.logprobs.tokens)
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **args)]
    assert "".join(c.text for c in chunks) == out.text
    streamed = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(out.logprobs.token_logprobs[1:], abs=1e-6)
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == out.logprobs.text_offset


def test_prompt_logprobs_on_both_routes(server, engine_run):
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 1, "prompt_logprobs": 3}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    got = _strict(response.text)["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(PROMPT_IDS)
    for position, entry in enumerate(got[1:], start=1):
        want = engine_run.prompt_logprobs[position]
        assert {int(t) for t in entry} == set(want)
        for token, value in entry.items():
            assert value["logprob"] == pytest.approx(want[int(token)].logprob, abs=1e-5)
            assert value["rank"] == want[int(token)].rank
            assert value["decoded_token"] == want[int(token)].decoded_token
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 2})
    assert chat.status_code == 200, chat.text
    prompt_logprobs = _strict(chat.text)["prompt_logprobs"]
    assert prompt_logprobs[0] is None and all(2 <= len(e) <= 3 for e in prompt_logprobs[1:])


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("constraint", [{"choice": ["yes", "no", "maybe"]}, {"regex": "[0-9]{2,4}"},
                                        {"json": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                  "required": ["a"]}}])
def test_constrained_logprobs_are_strict_json(server, route, stream, constraint):
    """Tokens the grammar forbids have logprob -inf: they go out as -9999.0, never as -Infinity."""
    body = {"model": "tiny", "max_tokens": 12, "temperature": 1.0, "seed": 3, "stream": stream,
            "structured_outputs": constraint}
    if route == "chat":
        body.update(messages=[{"role": "user", "content": "answer"}], logprobs=True, top_logprobs=20)
    else:
        body.update(prompt="answer", logprobs=20)
    response = httpx.post(f"{server.url}/v1/{'chat/completions' if route == 'chat' else 'completions'}",
                          json=body, timeout=120)
    assert response.status_code == 200, response.text
    texts = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")] if stream else [response.text]
    values = []
    for text in texts:
        if text == "[DONE]":
            continue
        for choice in _strict(text)["choices"]:
            logprobs = choice.get("logprobs")
            if not logprobs:
                continue
            if route == "chat":
                values += [t["logprob"] for entry in logprobs["content"] for t in entry["top_logprobs"]]
            else:
                values += [v for top in logprobs["top_logprobs"] for v in top.values()]
    assert -9999.0 in values  # a forbidden token among the top 20: the clamp was exercised
    assert min(values) == -9999.0


@pytest.mark.parametrize("route, body, field, message", [
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "stream=True"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options", "stream=True"),
    ("completions", {"prompt": "hi", "max_tokens": 200}, "max_tokens", "maximum context length is 128"),
    ("chat", {"max_completion_tokens": 500}, "max_completion_tokens", "maximum context length is 128"),
    ("chat", {"max_tokens": 126}, "max_tokens", "maximum context length is 128"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "greater than max allowed: 20"),
    ("chat", {"logprobs": True, "top_logprobs": 25}, "top_logprobs", "greater than max allowed: 20"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "greater than max allowed: 20"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream=True"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "at least 1"),
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]},
     "messages", "not a multimodal model"),
])
def test_vllms_400s_name_the_field(client, route, body, field, message):
    body = {"model": "tiny", **body}
    if route == "chat":
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as caught:
        client.post(f"/{'chat/completions' if route == 'chat' else 'completions'}", body=body, cast_to=object)
    assert caught.value.body["param"] == field, caught.value.body
    assert message in caught.value.body["message"]


def test_max_tokens_that_fit_are_served(client):
    out = client.completions.create(model="tiny", prompt=[5] * 100, max_tokens=28, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 28  # 100 + 28 = max_model_len: just fits


def test_version_models_retrieve_and_unknown_routes(server, client):
    version = httpx.get(server.url + "/version").json()
    assert isinstance(version["version"], str) and version["version"]
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("another-model")
    assert caught.value.body["code"] == "model_not_found"
    response = httpx.post(server.url + "/v1/embeddingz", json={})
    assert response.status_code == 404
    assert "does not exist" in response.json()["error"]["message"]


def test_a_client_that_leaves_is_one_info_line(server):
    """A dropped non-streamed request is aborted with one INFO line in the log, no traceback. (64 prompts of
    120 tokens over 8 sequences take seconds: the client leaves long before.)"""
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", timeout=0.3,
                   json={"model": "tiny", "prompt": [[5, 6, 7]] * 64, "max_tokens": 120, "ignore_eos": True})
    deadline = time.monotonic() + 30
    while "the client left" not in (log := open(server.log.name).read()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert log.count("the client left before the reply") == 1
    assert "Traceback" not in log and "ERROR" not in log
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("path, body, where", [
    ("/v1/completions", {"model": "\ud800", "prompt": "hi"}, "body.model"),
    ("/v1/completions", {"prompt": ["fine", "bad \udfff"]}, "body.prompt[1]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud83d alone"}]}, "body.messages[0].content"),
    ("/tokenize", {"prompt": "\ud800"}, "body.prompt"),
])
def test_lone_surrogates_are_a_400(server, path, body, where):
    """JSON can escape a lone UTF-16 surrogate, which is no text: a 400 saying where, never a 500."""
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as its \\u escape
    response = httpx.post(server.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400, response.text
    assert f"{where} holds a lone UTF-16 surrogate" in _strict(response.text)["error"]["message"]
    pair = json.dumps({"prompt": "an emoji \ud83d\ude00 is a valid pair", "max_tokens": 2})
    assert httpx.post(server.url + "/v1/completions", content=pair, headers={"Content-Type": "application/json"},
                      timeout=30).status_code == 200


@pytest.mark.parametrize("body, field, message", [
    ({"stop": ["x"] * 129}, "stop", "at most 128 strings, got 129 (the server's --max-stop-strings raises"),
    ({"stop": "y" * 1025}, "stop", "at most 1024 characters"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids", "at most 1024 ids"),
])
def test_stop_lists_are_bounded(client, body, field, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/completions", body={"model": "tiny", "prompt": "hi", **body}, cast_to=object)
    assert caught.value.body["param"] == field and message in caught.value.body["message"]


def test_an_unknown_model_is_named_safely(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="other\nmodel", prompt="hi", max_tokens=1)
    assert "'other\\nmodel' does not exist" in caught.value.body["message"]
