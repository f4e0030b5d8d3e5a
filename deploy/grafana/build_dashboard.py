"""Writes paged-dashboard.json, the Grafana dashboard over `paged serve`'s /metrics (one row per topic, one
series per replica). Run it after changing a panel: `python deploy/grafana/build_dashboard.py`; `--check`
fails when the committed JSON is not what this script writes (CI runs that).

Queries use Grafana's `$__rate_interval` (at least four scrape intervals, so a rate always has two samples)
and the dashboard's `$model_name` variable (one model or all). Replicas are told apart by `instance`, the
scrape target; within one process, by `engine`, the data-parallel replica.
"""

from __future__ import annotations

import json
import pathlib
import sys

OUT = pathlib.Path(__file__).with_name("paged-dashboard.json")
M = 'model_name=~"$model_name"'
R = "$__rate_interval"
NOT_OK = ', outcome!="ok"'


def rate(metric: str, extra: str = "") -> str:
    return f"rate({metric}{{{M}{extra}}}[{R}])"


def quantiles(histogram: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le, instance) ({rate(histogram + '_bucket')}))",
             f"P{int(q * 100)} {{{{instance}}}}") for q in (0.5, 0.99)]


# (row, title, unit, [(PromQL, legend)]): the order is the layout's.
PANELS = [
    ("Traffic", "Requests per second", "reqps",
     [(f"sum by (instance) ({rate('paged:api_requests_total')})", "{{instance}}")]),
    ("Traffic", "Errors per second by kind", "reqps",
     [(f"sum by (outcome) ({rate('paged:api_requests_total', NOT_OK)})", "{{outcome}}")]),
    ("Traffic", "Requests per second by API key", "reqps",
     [(f"sum by (key_name, outcome) ({rate('paged:api_requests_total')})", "{{key_name}} {{outcome}}")]),
    ("Traffic", "Tokens per second", "short",
     [(f"sum by (instance) ({rate('paged:prompt_tokens_total')})", "prompt {{instance}}"),
      (f"sum by (instance) ({rate('paged:generation_tokens_total')})", "generated {{instance}}")]),
    ("Traffic", "Tokens per second by API key", "short",
     [(f"sum by (key_name, kind) ({rate('paged:api_key_tokens_total')})", "{{key_name}} {{kind}}")]),
    ("Latency", "Time to first token", "s", quantiles("paged:time_to_first_token_seconds")),
    ("Latency", "Time per output token", "s", quantiles("paged:inter_token_latency_seconds")),
    ("Latency", "End-to-end request latency", "s", quantiles("paged:e2e_request_latency_seconds")),
    ("Latency", "Queue time", "s", quantiles("paged:request_queue_time_seconds")),
    ("Engine", "Running and waiting requests", "short",
     [(f"sum by (instance) (paged:num_requests_running{{{M}}})", "running {{instance}}"),
      (f"sum by (instance) (paged:num_requests_waiting{{{M}}})", "waiting {{instance}}")]),
    ("Engine", "KV cache usage", "percentunit",
     [(f"max by (instance, engine) (paged:kv_cache_usage_perc{{{M}}})", "{{instance}} engine {{engine}}")]),
    ("Engine", "Preemptions per second", "short",
     [(f"sum by (instance) ({rate('paged:num_preemptions_total')})", "{{instance}}")]),
    ("Engine", "Prefix cache hit rate", "percentunit",
     [(f"sum by (instance) ({rate('paged:prefix_cache_hits_total')}) / "
       f"sum by (instance) ({rate('paged:prefix_cache_queries_total')})", "{{instance}}")]),
    # The accelerator's allocator where the platform reports one (not on CPU), and the process's resident
    # memory: one query, so the panel has data on every platform.
    ("Engine", "Memory", "bytes",
     [(f'label_replace(sum by (instance) (paged:device_memory_used_bytes{{{M}}}), "memory", "device", "", "") or '
       f'label_replace(sum by (instance) (process_resident_memory_bytes * on (instance, job) group_left () '
       f'paged:engine_info{{{M}}}), "memory", "host RSS", "", "")', "{{memory}} {{instance}}")]),
    ("Replicas", "Replicas serving", "short",
     [(f"count by (model_name) (paged:engine_info{{{M}}})", "{{model_name}}")]),
    ("Replicas", "What each replica runs", "short",
     [(f"paged:engine_info{{{M}}}", "{{instance}}")]),
]


def panel(i: int, title: str, unit: str, targets: list[tuple[str, str]], y: int, x: int) -> dict:
    table = title == "What each replica runs"
    return {
        "id": i + 1, "type": "table" if table else "timeseries", "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {} if table else {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
                     **({"format": "table", "instant": True} if table else {})}
                    for j, (expr, legend) in enumerate(targets)],
    }


def dashboard() -> dict:
    panels, y, x, row = [], 0, 0, None
    for i, (row_title, title, unit, targets) in enumerate(PANELS):
        if row_title != row:
            y += 8 if x else 0
            panels.append({"id": 100 + len(panels), "type": "row", "title": row_title, "collapsed": False,
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
            row, x, y = row_title, 0, y + 1
        panels.append(panel(i, title, unit, targets, y, x))
        x += 8
        if x == 24:
            x, y = 0, y + 8
    datasource = {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus"}
    model = {"type": "query", "name": "model_name", "label": "Model", "includeAll": True, "allValue": ".*",
             "multi": True, "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(paged:engine_info, model_name)", "refId": "model_name"},
             "current": {"text": "All", "value": "$__all"}, "refresh": 2}
    return {"title": "paged", "uid": "paged-serving", "tags": ["paged", "llm"], "editable": True,
            "schemaVersion": 39, "version": 1, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
            "templating": {"list": [datasource, model]}, "panels": panels}


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        if OUT.read_text() != render():
            sys.exit(f"{OUT} is out of date: run python {__file__}")
    else:
        OUT.write_text(render())
