"""The OpenAI-compatible server, exercised over HTTP with the official `openai` client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from paged import LLM, SamplingParams
from tests.serving.server_fixture import Server

KEY = "test-key-123"
ENGINE_FLAGS = ["--block-size", "8", "--max-model-len", "256", "--max-num-seqs", "16"]
PROMPTS = ["Hello world", "The quick brown fox", "Paged attention keeps", "JAX compiles the step"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server(tiny_model_dir, "--api-key", KEY, *ENGINE_FLAGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def test_greedy_completion_matches_llm_generate(client, tiny_model_dir):
    llm = LLM(tiny_model_dir, block_size=8, max_model_len=256, show_progress=False)
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    result = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(result.choices, key=lambda c: c.index)] == [o.outputs[0].text for o in expected]
    assert all(c.finish_reason == "length" for c in result.choices)
    assert result.usage.completion_tokens == 4 * 12
    assert result.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)


def test_streamed_completion_equals_non_streamed(client):
    args = dict(model="tiny", prompt="Hello world", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20


def test_chat_completion_streamed_and_not(client):
    messages = [{"role": "user", "content": "Hello world"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant" and whole.object == "chat.completion"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_n_and_seed(client):
    args = dict(model="tiny", prompt="Hello", max_tokens=12, temperature=1.0, seed=7, n=2,
                extra_body={"ignore_eos": True})
    a = client.completions.create(**args)
    b = client.completions.create(**args)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text


def test_stop_string_streamed_and_not(client):
    base = dict(model="tiny", prompt="The quick brown fox", max_tokens=30, temperature=0,
                extra_body={"ignore_eos": True})
    full = client.completions.create(**base).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = full[:full.find(stop)]
    got = client.completions.create(stop=[stop], **base).choices[0]
    assert got.text == cut and got.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **base))
    assert streamed == cut, "streaming must hold back text that could start a stop string"


def test_logprobs(client):
    result = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=3,
                                       extra_body={"ignore_eos": True})
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        # Keys are decoded strings, so byte-level pieces that decode alike ("\ufffd") can merge: >= 1, <= 3.
        assert logprob <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(logprob, abs=1e-6)  # greedy picks the top token
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)


def test_models_tokenize_detokenize(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    headers = {"Authorization": f"Bearer {KEY}"}
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, headers=headers).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=headers).json()
    assert text["prompt"] == "Hello world"


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (json.dumps({"model": "tiny"}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "hi", "max_tokens": "many"}).encode(), 400, "max_tokens"),
    # Strict types: no coercion from strings, bools or floats.
    (json.dumps({"prompt": "hi", "max_tokens": "10"}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "hi", "max_tokens": True}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "hi", "max_tokens": 10.0}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "hi", "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"prompt": [True, False]}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "hi", "logit_bias": {"\u0663": 1}}).encode(), 400, "logit_bias"),  # an Arabic-Indic 3
    (json.dumps({"prompt": "hi", "n": 64}).encode(), 400, "n"),  # above the server's max_num_seqs (16)
    (b'{"prompt": "\xff\xfe"}', 400, None),  # not UTF-8
    (b'{"prompt": "hi", "stream_options": ' + b'{"a": ' * 5000 + b'1' + b'}' * 5001, 400, None),  # deep nesting
    (json.dumps({"prompt": "hi", "temperature": 7}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "hi", "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({"prompt": "hi", "n": 0}).encode(), 400, "n"),
    (json.dumps({"prompt": "hi " * 400}).encode(), 400, "prompt"),
    (json.dumps({"prompt": [10**7]}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "hi", "model": "gpt-4"}).encode(), 404, "model"),
    (json.dumps({"prompt": "hi", "logit_bias": {"abc": 1}}).encode(), 400, "logit_bias"),
    (json.dumps({"prompt": "hi", "logit_bias": {"5": 101}}).encode(), 400, "logit_bias"),
    (json.dumps({"prompt": "hi", "logit_bias": {"9999999": 1}}).encode(), 400, "logit_bias"),
])
def test_bad_input_gets_openai_shaped_4xx(server, client, body, status, param):
    response = httpx.post(server.url + "/v1/completions", content=body,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    # ... and the server keeps serving.
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices[0].finish_reason


def test_bad_chat_input_through_the_client(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=3)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi " * 400}])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


def test_auth(server):
    # Probes and scrapers carry no key (as vLLM leaves /health and /metrics open).
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
            response = httpx.request(method, server.url + path, headers=headers, json={"prompt": "hi"})
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_metrics_parse_and_count(server, client):
    client.completions.create(model="tiny", prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
    values = _metrics(server)
    for name in ("paged:num_requests_running", "paged:num_requests_waiting", "paged:kv_cache_usage_perc",
                 "paged:prompt_tokens_total", "paged:generation_tokens_total", "paged:num_preemptions_total",
                 "paged:request_success_total", "paged:time_to_first_token_seconds_count",
                 "paged:inter_token_latency_seconds_count", "paged:e2e_request_latency_seconds_count",
                 "paged:request_queue_time_seconds_count", "paged:prefix_cache_queries_total"):
        assert name in values, name
    assert values["paged:generation_tokens_total"] >= 3 and values["paged:request_success_total"] >= 1
    for name in ("paged:api_requests_total", "paged:api_key_tokens_total", "process_resident_memory_bytes"):
        assert name in values, name
    (info,) = [s.labels for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
               for s in f.samples if s.name == "paged:engine_info"]
    assert info["model_name"] == "tiny" and info["platform"] == "cpu" and info["dtype"] == "float32"
    assert info["max_model_len"] == "256" and info["block_size"] == "8" and info["version"]


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as response:
        lines = response.iter_lines()
        for _ in range(3):
            assert next(lines).startswith("data: ") or True
        assert _metrics(server)["paged:num_requests_running"] == 1
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        values = _metrics(server)
        if values["paged:num_requests_running"] == 0 and values["paged:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.2)
    assert values["paged:num_requests_running"] == 0
    assert values["paged:kv_cache_usage_perc"] == 0, "the aborted request's blocks must be freed"
    aborted = [s.value for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
               for s in f.samples if s.name == "paged:api_requests_total" and s.labels["outcome"] == "aborted"]
    assert sum(aborted) >= 1, "the stream the client left is counted as aborted"


def test_32_concurrent_streaming_clients(server, client):
    expected = {p: client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS}

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        return prompt, "".join([c.choices[0].text async for c in stream])

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, PROMPTS[i % 4]) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    assert all(text == expected[prompt] for prompt, text in results)


def test_backpressure_and_graceful_shutdown(tiny_model_dir):
    srv = Server(tiny_model_dir, "--max-num-seqs", "1", "--max-waiting-requests", "2", "--block-size", "8",
                 "--max-model-len", "512")
    try:
        async def one(aclient, i):
            try:
                r = await aclient.completions.create(model="tiny", prompt=f"Hello {i}", max_tokens=300,
                                                     extra_body={"ignore_eos": True})
                return r.choices[0].finish_reason
            except openai.APIStatusError as exc:
                return exc.status_code

        async def burst():
            async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as aclient:
                return await asyncio.gather(*(one(aclient, i) for i in range(8)))

        results = asyncio.run(burst())
        # One runs, two may wait; depending on when the first is scheduled 2 or 3 get in, the rest get 503.
        assert results.count("length") in (2, 3) and results.count(503) == 8 - results.count("length"), results
        assert set(results) <= {"length", 503}

        # SIGTERM with a stream in flight: the stream still completes and the process exits cleanly.
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 60, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(lines)
            assert first.startswith("data: ")
            srv.proc.send_signal(15)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        # uvicorn re-raises the signal once shutdown is complete, so the exit status is -SIGTERM.
        assert srv.proc.wait(60) in (0, -15)
        with open(srv.log.name) as log:
            assert "Application shutdown complete" in log.read()
    finally:
        srv.stop()


def test_echo_and_penalties_reach_the_sampler(client):
    base = dict(model="tiny", prompt="Hello world", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**base).choices[0].text
    echoed = client.completions.create(echo=True, **base).choices[0].text
    assert echoed == "Hello world" + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(echo=True, stream=True, **base))
    assert streamed == echoed
    penalised = client.completions.create(frequency_penalty=2.0, presence_penalty=2.0,
                                          **{**base, "max_tokens": 40}).choices[0].text
    repeated = client.completions.create(**{**base, "max_tokens": 40}).choices[0].text
    assert penalised != repeated


def test_logit_bias_through_the_client(client, tiny_model_dir):
    """The official client's logit_bias (token ids as keys) on both endpoints gives what LLM.generate gives
    with the same biases; the bias must change the output."""
    base = dict(model="tiny", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(prompt="Hello world", **base).choices[0].text
    llm = LLM(tiny_model_dir, block_size=8, max_model_len=256, show_progress=False)
    first = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    bias = {first.outputs[0].token_ids[0]: -100.0, 42: 5.0}
    want = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias=bias),
                        use_tqdm=False)[0].outputs[0].text
    wire = {str(t): b for t, b in bias.items()}
    got = client.completions.create(prompt="Hello world", logit_bias=wire, **base).choices[0].text
    assert got == want and got != plain
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(messages=messages, logit_bias={"42": 100}, **base)
    want_chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                  logit_bias={42: 100.0}), use_tqdm=False)[0].outputs[0]
    assert chat.choices[0].message.content == want_chat.text and want_chat.token_ids == [42] * 10


def test_serving_benchmark_against_the_server(server, tmp_path):
    from paged.benchmarks.serve import main
    out = tmp_path / "serve.json"
    code = main(["--base-url", server.url, "--api-key", KEY, "--num-prompts", "6", "--request-rate", "20",
                 "--input-len", "4", "16", "--output-len", "4", "12", "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["completed"] == 6 and result["failed"] == 0
    assert result["ttft_ms"]["median"] > 0 and result["output_token_throughput"] > 0


def test_serving_benchmark_reads_a_dataset(server, tmp_path, tiny_model_dir):
    """--dataset sends the file's prompts (text or token ids) with their output lengths; the token counts
    come from the server's usage, so text prompts count what the server's tokenizer made of them."""
    from paged.benchmarks.serve import main
    data = tmp_path / "requests.jsonl"
    lines = [{"prompt": "Hello world", "output_len": 5}, {"prompt_token_ids": [11, 12, 13], "output_len": 3},
             {"prompt": "The quick brown fox", "output_len": 7}]
    data.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    out = tmp_path / "serve.json"
    code = main(["--base-url", server.url, "--api-key", KEY, "--dataset", str(data), "--num-prompts", "10",
                 "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["completed"] == 3 and result["failed"] == 0 and result["num_prompts"] == 3
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)  # the completions endpoint adds special tokens
    prompt_tokens = sum(len(tokenizer.encode(p)) for p in ("Hello world", "The quick brown fox")) + 3
    assert result["total_token_throughput"] * result["duration_s"] == pytest.approx(prompt_tokens + 15)


def test_serving_benchmark_refuses_a_bad_dataset(tmp_path, capsys):
    from paged.benchmarks.serve import main
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "output_len": 2}) + "\n" + json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--base-url", "http://127.0.0.1:9", "--dataset", str(data)])
    assert exit_info.value.code == 2 and "bad.jsonl:2" in capsys.readouterr().err


CHAT = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("route, field, kwargs", [
    ("chat", "tool_choice", {"tools": [TOOL]}),  # auto (the default with tools) needs a tool-call parser
    ("chat", "tool_choice", {"tool_choice": "required"}),  # no tools to require
    ("completions", "tools", {"extra_body": {"tools": [TOOL]}}),
    ("completions", "suffix", {"suffix": " the end"}),
    ("completions", "best_of", {"best_of": 3}),
])
def test_unimplemented_meaning_changing_fields_are_a_400_naming_them(client, route, field, kwargs):
    with pytest.raises(openai.BadRequestError) as caught:
        if route == "chat":
            client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, **kwargs)
        else:
            client.completions.create(model="tiny", prompt="hi", max_tokens=3, **kwargs)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == field, caught.value.body


def test_fields_that_ask_for_the_default_are_served(client):
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, tool_choice="none",
                                         response_format={"type": "text"}, user="someone")
    assert out.choices[0].finish_reason in ("length", "stop")


def test_out_of_range_top_k_and_lone_surrogates_cost_only_their_request(server, client):
    """A top_k past int32 used to kill the engine thread when the step was prepared, and a prompt holding a
    lone UTF-16 surrogate raised a TypeError in the tokenizer on the engine thread (left hanging forever)."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for body, param in (({"prompt": "hi", "top_k": 2**31}, "top_k"), ({"prompt": "a\ud800b"}, "prompt")):
        response = httpx.post(server.url + "/v1/completions", content=json.dumps(body), headers=headers,
                              timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    response = httpx.post(server.url + "/tokenize", content=json.dumps({"prompt": "a\ud800b"}), headers=headers,
                          timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices[0].finish_reason


def test_disconnect_from_a_non_streamed_request_aborts_it(tiny_model_dir):
    """The auth middleware used to hide the disconnect from the route: a dropped non-streamed request ran to
    its end. Now it stops within a few steps of the drop (the whole request would take several seconds)."""
    srv = Server(tiny_model_dir, "--api-key", KEY, "--block-size", "16", "--max-model-len", "1024",
                 "--max-num-seqs", "16")
    # The counter's sample is named with _total by some prometheus_client versions, without by others.
    generated = lambda values: values.get("paged:generation_tokens_total", values.get("paged:generation_tokens"))
    try:
        body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 1000, "n": 16, "ignore_eos": True}
        # Compile the step's shapes first, so the timed request is generating when it is dropped.
        warm = httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 40},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        assert warm.status_code == 200
        before = generated(_metrics(srv))
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=0.5)
        at_drop = generated(_metrics(srv))  # one scrape after the connection closed
        dropped = time.monotonic()
        while time.monotonic() - dropped < 30 and _metrics(srv)["paged:num_requests_running"] > 0:
            time.sleep(0.02)
        values = _metrics(srv)
        assert values["paged:num_requests_running"] == 0 and values["paged:kv_cache_usage_perc"] == 0
        # Run to its end the request makes 16,000 tokens (it did before: the disconnect went unseen).
        made = generated(values) - before
        assert 0 < made < 16 * 1000 * 3 / 4, f"{made} tokens: the dropped request ran on"
        steps_after_drop = (generated(values) - at_drop) / 16  # each decode step adds one token to each sample
        print(f"steps run after the drop was seen by the scrape: {steps_after_drop:g}")
        assert steps_after_drop <= 3
    finally:
        srv.stop()


def test_503_carries_retry_after(tiny_model_dir):
    srv = Server(tiny_model_dir, *ENGINE_FLAGS, "--max-waiting-requests", "0")
    try:
        response = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "overloaded"
    finally:
        srv.stop()


@pytest.mark.parametrize("method, path, status", [("GET", "/nope", 404), ("PUT", "/v1/completions", 405),
                                                  ("GET", "/v1/chat/completions", 405)])
def test_routing_errors_come_in_openai_shape(server, method, path, status):
    response = httpx.request(method, server.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_head_health_and_body_limit_and_client_templates(server):
    assert httpx.head(server.url + "/health", timeout=10).status_code == 200
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    big = json.dumps({"prompt": "x" * (5 * 2**20)}).encode()  # over the 4 MiB default
    response = httpx.post(server.url + "/tokenize", content=big, headers=headers, timeout=30)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'x' * 10000000 }}"}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template"


def test_a_huge_prompt_is_refused_without_stalling_others(server, client):
    """A 3 MB prompt cannot fit max_model_len: refused by its length, in a worker, not on the engine thread."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    started = time.monotonic()
    response = httpx.post(server.url + "/v1/completions", content=json.dumps({"prompt": "ab " * 10**6}),
                          headers=headers, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert "max_model_len" in response.json()["error"]["message"]
    assert time.monotonic() - started < 5
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices[0].finish_reason


def test_disconnect_storm_leaks_nothing(server):
    """48 concurrent requests, streamed and not, a third dropped at random points: every completed one has
    its exact token count, and afterwards nothing runs, waits or holds a block."""
    import random

    rng = random.Random(5)
    headers = {"Authorization": f"Bearer {KEY}"}
    plans = [(i % 2 == 0, rng.randint(20, 60), rng.random() < 1 / 3, rng.uniform(0.05, 0.6)) for i in range(48)]

    async def one(client, stream, max_tokens, drop, delay):
        body = {"model": "tiny", "prompt": PROMPTS[max_tokens % 4], "max_tokens": max_tokens, "ignore_eos": True,
                "stream": stream, "stream_options": {"include_usage": True} if stream else None}

        async def run():
            if not stream:
                response = await client.post("/v1/completions", json=body, headers=headers)
                return response.json()["usage"]["completion_tokens"]
            usage = None
            async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and '"usage": {' in line:
                        usage = json.loads(line[6:])["usage"]["completion_tokens"]
            return usage

        if not drop:
            return await run()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(run(), delay)
        return None

    async def storm():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, *plan) for plan in plans))

    results = asyncio.run(storm())
    for (stream, max_tokens, drop, _), got in zip(plans, results):
        if not drop:
            assert got == max_tokens, (stream, max_tokens, got)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        values = _metrics(server)
        if values["paged:num_requests_running"] == values["paged:num_requests_waiting"] == 0 \
                and values["paged:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.1)
    assert values["paged:num_requests_running"] == 0 and values["paged:num_requests_waiting"] == 0
    assert values["paged:kv_cache_usage_perc"] == 0, "a dropped request leaked its blocks"


def test_streams_cut_by_the_shutdown_grace_end_with_an_error_event(tiny_model_dir):
    srv = Server(tiny_model_dir, "--block-size", "16", "--max-model-len", "1024", "--shutdown-grace-s", "2")
    try:
        # 64 x 1000 tokens take well over the grace (2 s) here, which therefore runs out first.
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 1000, "stream": True, "ignore_eos": True,
                "n": 64}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            srv.proc.send_signal(15)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["type"] == "server_error" and "grace" in error["message"]
    finally:
        srv.stop()


def test_trusted_client_templates_and_their_rendered_size(tiny_model_dir):
    srv = Server(tiny_model_dir, *ENGINE_FLAGS, "--trust-request-chat-template")
    try:
        messages = [{"role": "user", "content": "hi"}]
        ok = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={
            "messages": messages, "max_tokens": 2, "chat_template": "{{ messages[0]['content'] }} there"})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens"] == len(
            httpx.post(srv.url + "/tokenize", json={"prompt": "hi there", "add_special_tokens": False},
                       timeout=30).json()["tokens"])
        huge = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={
            "messages": messages, "max_tokens": 2, "chat_template": "{{ 'x' * 2000000 }}"})
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "messages"
        assert "rendered" in huge.json()["error"]["message"]
    finally:
        srv.stop()


def test_the_server_exits_non_zero_when_the_engine_loop_dies(tiny_model_dir):
    """A supervisor must see the failure: the engine loop dying fails the request in flight at once, /health
    goes 503, and the process exits with a non-zero status instead of answering 503 forever."""
    import subprocess
    import sys

    from tests.serving.server_fixture import free_port
    port = free_port()
    script = (
        "import sys, paged.engine as e\n"
        "def broken(self):\n"
        "    raise e.EngineBrokenError('injected: the KV pool is gone')\n"
        "e.LLMEngine.step = broken\n"
        "from paged.serving.cli import main\n"
        f"sys.exit(main(['serve', {tiny_model_dir!r}, '--port', '{port}', '--block-size', '8', "
        "'--max-model-len', '256']))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.3)
        response = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert response.status_code == 503 and "injected" in response.json()["error"]["message"]
        assert proc.wait(30) == 3
    finally:
        if proc.poll() is None:
            proc.kill()
