"""Smoke test of `paged bench kernels` at tiny sizes (the GPU run is the one that matters; docs/kernels.md)."""

from __future__ import annotations

import json

import numpy as np

from paged.serving.cli import main


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


def test_time_call_cycles_through_the_argument_sets():
    from paged.benchmarks.kernels import time_call
    calls = []

    def fn(x):
        calls.append(x)
        return np.zeros(1)

    seconds = time_call(fn, [(0,), (1,), (2,)], repeats=2, calls_per_sample=4)
    assert seconds >= 0
    # One warm-up call on the first set, then each sample's four calls cycle 0, 1, 2, 0.
    assert calls == [0] + [0, 1, 2, 0] * 2


def test_a_sweep_reports_every_finished_point_and_stops_at_its_deadline(tmp_path):
    import time

    from paged.benchmarks.kernels import PRESETS, Sweep, run_decode
    seen = []
    cfg = dict(PRESETS["smoke"], batch=[1], context=[16, 32, 64], gqa=[1])
    rows = run_decode(cfg, np.random.default_rng(0), Sweep(repeats=1, on_row=lambda rows: seen.append(len(rows))),
                      copy_bw=1e9, on_gpu=False, max_reference_bytes=1e9)
    assert [row["context"] for row in rows] == [16, 32, 64] and seen == [1, 2, 3]
    assert all(row["kv_copies"] == 1 for row in rows)  # no rotation asked for
    late = Sweep(repeats=1, deadline=time.monotonic() - 1)
    assert run_decode(cfg, np.random.default_rng(0), late, 1e9, False, 1e9) == []

    out = tmp_path / "kernels.json"
    assert main(["bench", "kernels", "--budget-s", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["rows"] == [] and report["copy_bytes_per_s"] > 0
