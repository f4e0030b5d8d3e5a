"""Smoke test of `paged bench kernels` at tiny sizes (the GPU run is the one that matters; docs/kernels.md)."""

from __future__ import annotations

import json

from serving.cli import main


def test_kernel_benchmark_reports_every_implementation(tmp_path):
    out = tmp_path / "kernels.json"
    args = ["bench", "kernels", "--batch", "2", "--context", "48", "--page-size", "8", "--gqa", "2",
            "--prefill-chunk", "16", "--repeats", "1", "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["copy_bytes_per_s"] > 0 and report["matmul_flops_per_s"] > 0
    kinds = [row["kind"] for row in report["rows"]]
    assert kinds == ["decode", "prefill"]
    for row in report["rows"]:
        timed = {name: r for name, r in row["results"].items() if "seconds" in r}
        assert {"pallas", "pallas-tpu", "xla", "jnp-reference"} <= set(timed)
        # Every implementation computes the same attention (float32 here).
        assert all(r["max_abs_diff_vs_first"] < 1e-4 for r in timed.values())
    decode = report["rows"][0]
    assert decode["kv_bytes"] == 2 * 2 * 48 * 2 * 64 * 4
    assert "skipped" in decode["results"]["jax-pallas-ops"]  # GPU only
