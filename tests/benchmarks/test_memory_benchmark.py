"""Smoke test of benchmarks/memory.py on a tiny workload (the real run is documented in docs/performance.md)."""

from __future__ import annotations

import importlib.util
import json
import pathlib


def test_memory_benchmark_runs_and_reports(tmp_path):
    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "memory.py"
    spec = importlib.util.spec_from_file_location("memory_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "memory.json"
    assert module.main(["--requests", "12", "--min-len", "4", "--max-len", "40", "--budget-tokens", "512",
                        "--block-size", "8", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # Waste is at most one partial block per running sequence, far below contiguous reservation.
    assert 0.5 < result["paged_utilization"] <= 1.0
    assert result["contiguous_max_len_utilization"] < result["contiguous_per_request_utilization"] <= 1.0
    assert result["paged_utilization"] > result["contiguous_per_request_utilization"]
    assert result["paged_peak_concurrency"] > result["contiguous_max_len_concurrency"]
