"""Two `paged serve` replicas behind the committed nginx config (the real nginx): requests spread over both,
and one replica stopped under load loses no request nginx could retry; its open streams end with an error
event, never cut."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.components import binary, nginx
from tests.serving.server_fixture import Server, free_port

FLAGS = ["--block-size", "8", "--max-model-len", "1024", "--max-num-seqs", "16", "--shutdown-grace-s", "1"]


@pytest.fixture(scope="module")
def replicas(tiny_model_dir):
    binary("nginx")  # before starting anything
    servers = [Server(tiny_model_dir, *FLAGS, wait=False) for _ in range(2)]
    try:
        for server in servers:
            server.wait_healthy()
        yield servers
    finally:
        for server in servers:
            server.stop()


def _served(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "paged:api_requests_total" and s.labels["outcome"] == "ok")


async def _request(client: httpx.AsyncClient, stream: bool, max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream}
    if not stream:
        response = await client.post("/v1/completions", json=body)
        ok = response.status_code == 200 and len(response.json()["choices"][0]["text"]) > 0
        return {"stream": False, "status": response.status_code, "upstream": response.headers.get("x-paged-upstream"),
                "ok": ok, "body": response.text[:300]}
    events = []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            upstream = response.headers.get("x-paged-upstream")
            status = response.status_code
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.HTTPError as exc:  # a cut stream (what must not happen)
        return {"stream": True, "status": -1, "upstream": None, "ok": False, "body": repr(exc), "events": events}
    done = bool(events) and events[-1] == "[DONE]"
    error = any(e.startswith('{"error"') for e in events)
    tokens = sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in events if e.startswith('{"id"'))
    return {"stream": True, "status": status, "upstream": upstream, "done": done, "error": error,
            "ok": status == 200 and done and not error and tokens > 0, "events": events}


def test_requests_spread_and_a_stopped_replica_loses_nothing_retryable(replicas, tmp_path):
    a, b = replicas
    port = free_port()
    with nginx(tmp_path / "nginx", port, [a.port, b.port]) as url:

        served: list[float] = []

        async def run() -> tuple[list[dict], list[dict]]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                # Both replicas serve: least_conn spreads concurrent requests.
                warm = await asyncio.gather(*(_request(client, i % 2 == 0, 8) for i in range(12)))
                served.extend([_served(a), _served(b)])  # from each replica's own /metrics

                # Under load, replica b is stopped (SIGTERM: it stops accepting, then fails what is left when
                # its 1 s grace period runs out).
                results: list[dict] = []
                stop_at = time.monotonic() + 1.5
                end_at = stop_at + 5.0

                async def worker(i: int):
                    n = 0
                    while time.monotonic() < end_at:
                        results.append(await _request(client, (i + n) % 2 == 0, 16))
                        n += 1

                async def long_streams():
                    # Opened just before the stop, these outlast the grace period: least_conn puts some on b.
                    await asyncio.sleep(max(0.0, stop_at - 0.3 - time.monotonic()))
                    results.extend(await asyncio.gather(*(_request(client, True, 1000) for _ in range(6))))

                async def stopper():
                    await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
                    b.proc.send_signal(signal.SIGTERM)

                await asyncio.gather(stopper(), long_streams(), *(worker(i) for i in range(6)))
                return warm, results

        warm, results = asyncio.run(run())
        assert b.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down

    addr = {f"127.0.0.1:{a.port}": "a", f"127.0.0.1:{b.port}": "b"}
    assert all(r["ok"] for r in warm), [r for r in warm if not r["ok"]]
    assert {addr.get(r["upstream"]) for r in warm} == {"a", "b"}
    assert served[0] > 0 and served[1] > 0 and sum(served) == len(warm)

    on_b_streams = [r for r in results if r["stream"] and addr.get(r["upstream"]) == "b"]
    retryable = [r for r in results if r not in on_b_streams]
    failed = [r for r in retryable if not r["ok"]]
    assert not failed, failed[:3]
    # nginx sent later requests to a (retrying those b refused): some completed there after b stopped.
    assert sum(addr.get(r["upstream"]) == "a" for r in retryable) > len(retryable) // 2
    # The streams open on b when it stopped end with an error event and [DONE] (or finished in time).
    assert on_b_streams, "no stream was open on the stopped replica: the test did not test the stop"
    assert all(r["status"] == 200 and r["done"] and (r["ok"] or r["error"]) for r in on_b_streams), on_b_streams
    cut = [r for r in on_b_streams if r["error"]]
    assert cut, "no stream outlasted the grace period"
    message = json.loads(cut[0]["events"][-2])["error"]["message"]
    assert "shutting down" in message
    print(f"\n{len(results)} requests under load: {len(retryable)} retryable, all succeeded "
          f"({sum(addr.get(r['upstream']) == 'a' for r in retryable)} on a); {len(on_b_streams)} streams open on b, "
          f"{len(cut)} ended with an error event")
