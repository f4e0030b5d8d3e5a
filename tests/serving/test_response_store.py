"""The response store: bounded by bytes and age, each response visible to its own API key only; through the app,
GET / DELETE and previous_response_id honour the key, and a server that keeps none says so."""

from __future__ import annotations

import asyncio
import json

import httpx

from paged.serving.response_store import ResponseStore


def _response(response_id: str, text: str = "hi") -> dict:
    return {"id": response_id, "object": "response", "output": [{"type": "message", "content": text}]}


def _size(response: dict, items: list) -> int:
    return len(json.dumps(response)) + len(json.dumps(items))


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_oldest_go_first_once_the_bytes_are_over_the_bound():
    items = [{"type": "message", "role": "user", "content": "x" * 100}]
    one = _size(_response("resp_0"), items)
    store = ResponseStore(max_bytes=3 * one, ttl_s=60)
    for i in range(5):
        assert store.put(_response(f"resp_{i}"), items, "k")
    assert len(store) == 3 and store.bytes_used == 3 * one
    assert [store.get(f"resp_{i}", "k") is not None for i in range(5)] == [False, False, True, True, True]
    # One too big for the whole store is not kept, and pushes nothing out.
    assert not store.put(_response("resp_big", "y" * (3 * one)), items, "k")
    assert store.get("resp_big", "k") is None and len(store) == 3


def test_a_response_is_forgotten_after_its_time():
    clock = _Clock()
    store = ResponseStore(max_bytes=10**6, ttl_s=10, clock=clock)
    store.put(_response("resp_a"), [], "k")
    clock.now = 5
    store.put(_response("resp_b"), [], "k")
    clock.now = 10.5
    assert store.get("resp_a", "k") is None and store.get("resp_b", "k") is not None
    clock.now = 15.5
    assert store.get("resp_b", "k") is None and len(store) == 0 and store.bytes_used == 0


def test_only_the_key_that_made_a_response_reads_or_deletes_it():
    store = ResponseStore(max_bytes=10**6, ttl_s=60)
    store.put(_response("resp_a"), [{"role": "user", "content": "secret"}], "alice")
    assert store.get("resp_a", "bob") is None and not store.delete("resp_a", "bob")
    entry = store.get("resp_a", "alice")
    assert entry.input_items == [{"role": "user", "content": "secret"}]
    assert store.delete("resp_a", "alice") and store.get("resp_a", "alice") is None and store.bytes_used == 0


def test_storing_the_same_id_again_replaces_it_and_its_bytes():
    store = ResponseStore(max_bytes=10**6, ttl_s=60)
    store.put(_response("resp_a", "short"), [], "k")
    store.put(_response("resp_a", "a longer reply"), [], "k")
    assert len(store) == 1 and store.bytes_used == _size(_response("resp_a", "a longer reply"), [])


def test_a_store_of_zero_bytes_keeps_nothing():
    store = ResponseStore(max_bytes=0, ttl_s=60)
    assert not store.enabled and not store.put(_response("resp_a"), [], "k") and len(store) == 0


def _app(tiny_model_dir, **limits):
    from transformers import AutoTokenizer

    from paged.serving.api_keys import ApiKey
    from paged.serving.app import build_app
    from paged.serving.state import ServerLimits
    from tests.serving.test_reasoning import _ScriptedEngine

    engine = _ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir), ["The answer", " is 4."])
    return build_app(engine, "tiny", api_keys=[ApiKey("alice", "sk-alice"), ApiKey("bob", "sk-bob")],
                     limits=ServerLimits(**limits))


def _calls(app, calls):
    """Runs (method, path, key, json) calls in order against the app; their replies."""
    async def run():
        replies = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
            for method, path, key, body in calls:
                replies.append(await client.request(method, path, json=body,
                                                    headers={"Authorization": f"Bearer {key}"}))
        return replies
    return asyncio.run(run())


def test_another_keys_response_is_a_404_everywhere(tiny_model_dir):
    app = _app(tiny_model_dir)
    (made,) = _calls(app, [("POST", "/v1/responses", "sk-alice", {"model": "tiny", "input": "2 + 2?"})])
    rid = made.json()["id"]
    assert made.json()["store"] is True
    get_bob, continue_bob, delete_bob, get_alice = _calls(app, [
        ("GET", f"/v1/responses/{rid}", "sk-bob", None),
        ("POST", "/v1/responses", "sk-bob", {"model": "tiny", "input": "and?", "previous_response_id": rid}),
        ("DELETE", f"/v1/responses/{rid}", "sk-bob", None),
        ("GET", f"/v1/responses/{rid}", "sk-alice", None)])
    assert get_bob.status_code == continue_bob.status_code == delete_bob.status_code == 404
    assert continue_bob.json()["error"]["param"] == "previous_response_id"
    assert get_alice.status_code == 200 and get_alice.json() == made.json()


def test_a_server_that_keeps_no_responses_refuses_a_continuation(tiny_model_dir):
    app = _app(tiny_model_dir, responses_store_bytes=0)
    made, continued, got = _calls(app, [
        ("POST", "/v1/responses", "sk-alice", {"model": "tiny", "input": "2 + 2?"}),
        ("POST", "/v1/responses", "sk-alice", {"model": "tiny", "input": "and?", "previous_response_id": "resp_x"}),
        ("GET", "/v1/responses/resp_x", "sk-alice", None)])
    assert made.status_code == 200 and made.json()["store"] is False
    assert continued.status_code == 400 and continued.json()["error"]["param"] == "previous_response_id"
    assert "--responses-store-mb" in continued.json()["error"]["message"]
    assert got.status_code == 404
