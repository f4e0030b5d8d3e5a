"""The committed Grafana dashboard against a real Prometheus (the Debian binary, with the committed scrape
config) scraping a real `paged serve` under load: every panel's every query returns data."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time

import httpx
import pytest

from tests.deploy.components import DEPLOY, binary, prometheus
from tests.serving.server_fixture import Server, free_port

DASHBOARD = DEPLOY / "grafana" / "paged-dashboard.json"
KEYS = [{"name": "team-a", "key": "sk-a"}, {"name": "team-b", "key": "sk-b", "requests_per_minute": 5}]
RATE_WINDOW = "20s"  # what Grafana's $__rate_interval becomes here: several 1 s scrapes of the load run


def panels() -> list[dict]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def test_the_committed_dashboard_is_what_its_script_writes():
    result = subprocess.run([sys.executable, str(DEPLOY / "grafana" / "build_dashboard.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "model_name"}
    for panel in panels():
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert '$model_name' in target["expr"], (panel["title"], target["expr"])


async def _load(url: str, seconds: float) -> None:
    """Mixed traffic for two keys: streams and not, shared prefixes (prefix-cache hits), one key over its
    request limit (429s) and some invalid requests (errors by kind)."""
    prefix = "You are a helpful assistant. Answer briefly and well. "
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        end = time.monotonic() + seconds

        async def worker(i: int):
            n = 0
            while time.monotonic() < end:
                key = "sk-b" if i == 0 else "sk-a"
                body = {"model": "tiny", "prompt": prefix * 3 + f"question {i}-{n}", "max_tokens": 12,
                        "ignore_eos": True, "stream": n % 2 == 0}
                if n % 7 == 6:
                    body["temperature"] = -1  # invalid: a 400
                await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
                n += 1

        await asyncio.gather(*(worker(i) for i in range(4)))


def test_every_panel_returns_data_from_prometheus(tiny_model_dir, tmp_path):
    binary("prometheus")
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    server = Server(tiny_model_dir, "--api-keys-file", str(keys), "--block-size", "8", "--max-model-len", "256")
    try:
        port = free_port()
        with prometheus(tmp_path / "prometheus", port, [f"127.0.0.1:{server.port}"]) as prom:
            asyncio.run(_load(server.url, 8.0))
            time.sleep(2.5)  # the last scrapes after the load
            report, empty = [], []
            for panel in panels():
                for target in panel["targets"]:
                    expr = target["expr"].replace("$__rate_interval", RATE_WINDOW).replace("$model_name", ".*")
                    response = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
                    assert response.status_code == 200, (panel["title"], expr, response.text)
                    result = response.json()["data"]["result"]
                    values = [float(r["value"][1]) for r in result]
                    finite = [v for v in values if math.isfinite(v)]
                    report.append(f"{panel['title']} [{target['refId']}]: {len(result)} series, "
                                  f"values {[round(v, 4) for v in finite[:4]]}")
                    if not finite:
                        empty.append((panel["title"], expr, result))
            print("\n" + "\n".join(report))
            assert not empty, empty
    finally:
        server.stop()
