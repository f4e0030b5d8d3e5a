"""Smoke test of `paged bench throughput` on a tiny workload (the real run is in docs/performance.md)."""

from __future__ import annotations

import json


from serving.cli import main


def test_throughput_benchmark_reports_every_system(tiny_model_dir, tmp_path):
    out = tmp_path / "throughput.json"
    args = ["bench", "throughput", "--model", tiny_model_dir, "--num-requests", "4", "--input-len", "4", "12",
            "--output-len", "4", "12", "--no-hf-continuous", "--hf-batch-sizes", "all", "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    systems = [r["system"] for r in report["results"]]
    try:
        import torch  # noqa: F401
        assert systems == ["paged", "hf-static-b4"]
    except ImportError:
        assert systems == ["paged"]
    paged = report["results"][0]
    assert paged["compilations_in_timed_run"] == 0, "warm-up must have compiled everything the run needs"
    # Run again: this time paged's warm-up loads what the first run compiled.
    assert main(args) == 0
    again = json.loads(out.read_text())["results"][0]
    assert again["compilation_cache_dir"] == paged["compilation_cache_dir"]
    assert again["warmup_compilation_cache_hits"] > 0
    assert paged["output_tokens_per_s"] > 0 and 0 < paged["mfu"] < 1
    assert report["workload"]["requests"] == 4
