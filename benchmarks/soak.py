"""Soak: `paged serve` under a mix of well-behaved, rude and invalid clients for a while, watched from outside.

    paged bench soak [--model paged-demo-docstrings] [--duration-s 300] [--clients 8] [--json out.json]
        [-- extra flags for paged serve]

Starts `paged serve` on the model, then runs --clients loops until the deadline. Each takes these in turns, in
a random order each turn: a completion, a chat, a stream read to its end, a stream left after its first chunk, a request left
before its reply (the client gives up after 50 ms), a constrained (JSON schema) completion, a batch of prompts
with n=2 and logprobs, and a request the server must refuse (400). Every 2 s it samples the server's
resident memory (VmRSS of its process) and the time `/health` takes. At the end it waits for the engine to go
idle and reads its metrics.

Reports the status codes by kind (the run fails on any 5xx or an unexpected code), /health latency, resident
memory at the start of the second quarter, at the end, and its maximum (the run fails when it grew more than
--max-rss-growth-mb between the two), and the running requests and KV usage once idle (both must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

from paged.benchmarks.common import report

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer"}}, "required": ["name", "count"]}
# kind -> status codes that are correct for it (0: the client left before any status).
EXPECTED = {"completion": {200}, "chat": {200}, "stream": {200}, "stream_left": {200}, "left": {0, 200},
            "constrained": {200}, "batch": {200}, "invalid": {400}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def _request(client: httpx.AsyncClient, kind: str, rng: random.Random, model: str) -> int:
    """One request of `kind`; its status code (0 when the client left before one came)."""
    words = " ".join(rng.choice(["def", "return", "class", "self", "value", "list", "the", "of"])
                     for _ in range(rng.randint(4, 60)))
    body = {"model": model, "prompt": words, "max_tokens": rng.randint(4, 48), "temperature": rng.choice([0, 0.8])}
    if kind == "chat":
        body = {"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": body["max_tokens"]}
        return (await client.post("/v1/chat/completions", json=body)).status_code
    if kind == "constrained":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
        body["max_tokens"] = 64
        return (await client.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": words}], "max_tokens": 64,
            "response_format": body["response_format"]})).status_code
    if kind == "batch":
        body.update(prompt=[words] * rng.randint(2, 8), n=2, logprobs=3)
    if kind == "invalid":
        body.update(rng.choice([{"temperature": -1}, {"logprobs": 99}, {"stop": ["x"] * 500}, {"n": 10**6},
                                {"max_tokens": 10**9}, {"logit_bias": {"-5": 1}}]))
    if kind == "left":
        try:
            return (await client.post("/v1/completions", json={**body, "max_tokens": 64}, timeout=0.05)).status_code
        except httpx.TimeoutException:
            return 0
    if kind in ("stream", "stream_left"):
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            async for line in response.aiter_lines():
                if kind == "stream_left" and line.startswith("data: "):
                    break  # leaves with the stream still running
            return response.status_code
    return (await client.post("/v1/completions", json=body)).status_code


async def _client(base_url: str, model: str, deadline: float, seed: int, counts: collections.Counter) -> None:
    rng = random.Random(seed)
    turn: list[str] = []  # every kind once per turn, in a random order: a short run still meets them all
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        while time.monotonic() < deadline:
            turn = turn or rng.sample(list(EXPECTED), len(EXPECTED))
            kind = turn.pop()
            try:
                status = await _request(client, kind, rng, model)
            except httpx.HTTPError as exc:
                status = f"{type(exc).__name__}"
            counts[(kind, status)] += 1


async def _watch(base_url: str, pid: int, deadline: float, samples: list) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        while time.monotonic() < deadline:
            start = time.perf_counter()
            try:
                status = (await client.get("/health")).status_code
            except httpx.HTTPError:
                status = 0  # counted in health_s.non_200
            samples.append((time.monotonic(), _rss_bytes(pid), time.perf_counter() - start, status))
            await asyncio.sleep(2)


def _metric(text: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
              or line.startswith(name + " ")]
    return sum(values)


async def _soak(args, base_url: str, pid: int) -> dict:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
    start = time.monotonic()
    deadline = start + args.duration_s
    counts, samples = collections.Counter(), []
    await asyncio.gather(_watch(base_url, pid, deadline, samples),
                         *(_client(base_url, model, deadline, args.seed + i, counts) for i in range(args.clients)))
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        for _ in range(120):  # requests left by their clients finish or are aborted
            metrics = (await client.get("/metrics")).text
            if _metric(metrics, "paged:num_requests_running") == 0 and _metric(metrics, "paged:num_requests_waiting") == 0:
                break
            await asyncio.sleep(0.5)
    unexpected = {f"{kind} -> {status}": n for (kind, status), n in counts.items()
                  if status not in EXPECTED[kind]}
    times, rss, health, health_status = (np.array(column) for column in zip(*samples))
    second_quarter = rss[times - start >= args.duration_s / 4]
    return {
        "duration_s": args.duration_s, "clients": args.clients,
        "requests": sum(counts.values()),
        "by_kind": {f"{kind} -> {status}": n for (kind, status), n in sorted(counts.items(), key=str)},
        "server_errors": sum(n for (_, status), n in counts.items() if isinstance(status, int) and status >= 500),
        "unexpected": unexpected,
        "health_s": {"p50": float(np.median(health)), "p99": float(np.percentile(health, 99)),
                     "max": float(health.max()), "non_200": int((health_status != 200).sum())},
        "rss_bytes": {"second_quarter_start": int(second_quarter[0]) if len(second_quarter) else None,
                      "end": int(rss[-1]), "max": int(rss.max())},
        # Growth once warm (the first quarter loads tokenizers, grammars, allocator pools): held to
        # --max-rss-growth-mb.
        "rss_growth_after_first_quarter_mb": round(float(rss[-1] - second_quarter[0]) / 2**20, 1)
        if len(second_quarter) else None,
        # (seconds into the run, MB) every 30 s: whether memory settles or keeps growing
        "rss_mb_every_30s": [(round(float(t - start)), round(float(r) / 2**20, 1))
                             for t, r in zip(times[::15], rss[::15])],
        "idle_running": _metric(metrics, "paged:num_requests_running"),
        "idle_waiting": _metric(metrics, "paged:num_requests_waiting"),
        "idle_kv_cache_usage": _metric(metrics, "paged:kv_cache_usage_perc"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="paged-demo-docstrings")
    parser.add_argument("--duration-s", type=float, default=300)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout-s", type=float, default=600)
    parser.add_argument("--json", default=None)
    parser.add_argument("--max-rss-growth-mb", type=float, default=32,
                        help="fail when resident memory grows more than this after the first quarter (default 32)")
    parser.add_argument("serve_args", nargs="*", help="extra flags for paged serve (after --)")
    args = parser.parse_args(argv)
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "paged.serving.cli", "serve", args.model, "--port", str(port),
                               "--host", "127.0.0.1", "--log-level", "warning", *args.serve_args],
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base_url = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        while True:
            if server.poll() is not None:
                print(f"paged serve exited with {server.returncode} before it was ready", file=sys.stderr)
                return 2
            try:
                if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - started > args.startup_timeout_s:
                print("paged serve did not become ready", file=sys.stderr)
                return 2
            time.sleep(0.5)
        result = asyncio.run(_soak(args, base_url, server.pid))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    report(result, args.json)
    growth = result["rss_growth_after_first_quarter_mb"]
    healthy = (result["server_errors"] == 0 and not result["unexpected"] and result["idle_running"] == 0
               and result["idle_kv_cache_usage"] == 0 and (growth is None or growth <= args.max_rss_growth_mb))
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
