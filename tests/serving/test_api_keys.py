"""API keys with per-minute limits: the key ring alone (a fake clock), then a real server driven past the
limits with the official `openai` client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from paged.serving.api_keys import ApiKey, KeyRing, RateLimited, parse_api_keys
from tests.serving.server_fixture import Server


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_request_limit_bursts_to_the_limit_then_refills_at_its_rate():
    clock = Clock()
    ring = KeyRing([ApiKey("a", "sa", requests_per_minute=3)], clock)
    for _ in range(3):
        ring.admit("a", 10)
    with pytest.raises(RateLimited) as refused:
        ring.admit("a", 10)
    # 3 a minute refill one request every 20 s.
    assert refused.value.kind == "requests" and refused.value.retry_after_s == pytest.approx(20.0)
    clock.now += 19.0
    with pytest.raises(RateLimited) as refused:
        ring.admit("a", 10)
    assert refused.value.retry_after_s == pytest.approx(1.0)
    clock.now += 1.0
    ring.admit("a", 10)
    clock.now += 3600  # a long idle time refills to the limit, not beyond it
    for _ in range(3):
        ring.admit("a", 10)
    with pytest.raises(RateLimited):
        ring.admit("a", 10)


def test_token_limit_charges_prompts_at_admission_and_generated_tokens_as_debt():
    clock = Clock()
    ring = KeyRing([ApiKey("t", "st", tokens_per_minute=120), ApiKey("free", "sf")], clock)
    ring.admit("t", 100)
    ring.charge("t", 50)  # the level is now 120 - 150 = -30
    with pytest.raises(RateLimited) as refused:
        ring.admit("t", 10)
    # 2 tokens a second: from -30 to 10 takes 20 s.
    assert refused.value.kind == "tokens" and refused.value.retry_after_s == pytest.approx(20.0)
    clock.now += 20.0
    ring.admit("t", 10)
    with pytest.raises(RateLimited) as too_large:
        ring.admit("t", 121)
    assert too_large.value.retry_after_s is None and "too large" in str(too_large.value)
    for _ in range(100):  # a key without limits is never refused
        ring.admit("free", 10_000)
        ring.charge("free", 10_000)


def test_a_refused_request_takes_nothing():
    clock = Clock()
    ring = KeyRing([ApiKey("both", "s", requests_per_minute=2, tokens_per_minute=60)], clock)
    ring.admit("both", 50)
    with pytest.raises(RateLimited):
        ring.admit("both", 50)  # over tokens: its request is not taken either
    ring.admit("both", 10)  # the second request of the minute still fits
    with pytest.raises(RateLimited) as refused:
        ring.admit("both", 0)
    assert refused.value.kind == "requests"


def test_identify_and_parse(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"name": "team-a", "key": "secret-a", "requests_per_minute": 5},
                                {"name": "team-b", "key": "secret-b", "tokens_per_minute": 1000}]))
    keys = parse_api_keys(["flag-secret"], str(path))
    assert [(k.name, k.requests_per_minute, k.tokens_per_minute) for k in keys] == [
        ("key-0", None, None), ("team-a", 5, None), ("team-b", None, 1000)]
    ring = KeyRing(keys)
    assert ring.identify("secret-b").name == "team-b" and ring.identify("flag-secret").name == "key-0"
    assert ring.identify("secret-") is None and ring.identify("") is None
    assert "secret" not in repr(keys)
    for bad, message in (([{"name": "x"}], "must be an object with name and key"),
                         ([{"name": "x", "key": "k", "rpm": 3}], "must be an object"),
                         ([{"name": "x", "key": "k", "requests_per_minute": 0}], "positive integer"),
                         ([{"name": "x", "key": "k"}, {"name": "x", "key": "j"}], "unique"),
                         ({"name": "x"}, "JSON list")):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            parse_api_keys(None, str(path))


# ---- a real server ---------------------------------------------------------------------------------

KEYS = [{"name": "slow", "key": "sk-slow-secret", "requests_per_minute": 3},
        {"name": "fast", "key": "sk-fast-secret", "requests_per_minute": 1000},
        {"name": "tokens", "key": "sk-tokens-secret", "tokens_per_minute": 60}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    srv = Server(tiny_model_dir, "--api-keys-file", str(path), "--block-size", "8", "--max-model-len", "256")
    yield srv
    srv.stop()


def _client(server, key):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def _samples(server) -> dict[tuple, float]:
    text = httpx.get(server.url + "/metrics").text
    for entry in KEYS:
        assert entry["key"] not in text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples, name, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def test_only_the_key_over_its_limit_gets_429_with_retry_after(server):
    slow, fast = _client(server, "sk-slow-secret"), _client(server, "sk-fast-secret")
    outcomes = {"slow": [], "fast": []}
    for _ in range(5):
        for name, client in (("slow", slow), ("fast", fast)):
            try:
                client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
                outcomes[name].append("ok")
            except openai.RateLimitError as exc:
                outcomes[name].append(exc.response.headers["retry-after"])
                body = exc.response.json()["error"]
                assert body["code"] == "rate_limit_exceeded" and body["type"] == "requests"
                assert "slow" in body["message"]
    assert outcomes["fast"] == ["ok"] * 5
    assert outcomes["slow"][:3] == ["ok"] * 3
    # 3 a minute: the next request is admitted 20 s after the first.
    assert all(retry.isdigit() and 1 <= int(retry) <= 20 for retry in outcomes["slow"][3:])
    samples = _samples(server)
    assert _value(samples, "paged:api_requests_total", key_name="slow", outcome="ok") == 3
    assert _value(samples, "paged:api_requests_total", key_name="slow", outcome="rate_limited") == 2
    assert _value(samples, "paged:api_requests_total", key_name="fast", outcome="ok") == 5
    assert _value(samples, "paged:api_requests_total", key_name="fast", outcome="rate_limited") == 0
    assert _value(samples, "paged:api_key_tokens_total", key_name="fast", kind="generation") == 10


def test_token_limit_counts_generated_tokens(server):
    client = _client(server, "sk-tokens-secret")
    first = client.completions.create(model="tiny", prompt=[1, 2, 3, 4], max_tokens=60,
                                      extra_body={"ignore_eos": True})
    assert first.usage.total_tokens == 64  # 60 a minute: the key is 4 tokens in debt
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert refused.value.response.json()["error"]["type"] == "tokens"
    assert int(refused.value.response.headers["retry-after"]) >= 4  # 1 token a second, from -4 to the prompt
    with pytest.raises(openai.RateLimitError, match="too large"):
        client.completions.create(model="tiny", prompt=list(range(1, 62)), max_tokens=1)
    samples = _samples(server)
    assert _value(samples, "paged:api_key_tokens_total", key_name="tokens", kind="prompt") == 4
    assert _value(samples, "paged:api_key_tokens_total", key_name="tokens", kind="generation") == 60
    assert _value(samples, "paged:api_requests_total", key_name="tokens", route="chat_completions",
                  outcome="rate_limited") == 1


def test_unknown_keys_are_refused_and_counted(server):
    with pytest.raises(openai.AuthenticationError):
        _client(server, "sk-wrong").completions.create(model="tiny", prompt="Hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        _client(server, "sk-fast-secret").completions.create(model="tiny", prompt="Hello", max_tokens=2,
                                                             temperature=-1)
    samples = _samples(server)
    assert _value(samples, "paged:api_requests_total", key_name="anonymous", outcome="unauthorized") == 1
    assert _value(samples, "paged:api_requests_total", key_name="fast", outcome="invalid") == 1
