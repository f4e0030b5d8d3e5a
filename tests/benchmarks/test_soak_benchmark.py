"""Smoke test of `paged bench soak` (the 5-minute run is in docs/deployment.md)."""

from __future__ import annotations

import json

from paged.benchmarks.soak import EXPECTED, main


def test_a_short_soak_ends_idle_with_no_server_error(tmp_path):
    out = tmp_path / "soak.json"
    # Steps compile on first use here (--enforce-eager), so memory is not yet settled: no growth bound to speak of.
    # With a cold compilation cache (a fresh CI machine) the compiles take about 7 s of the run.
    assert main(["--duration-s", "14", "--clients", "3", "--json", str(out), "--max-rss-growth-mb", "1024", "--",
                 "--enforce-eager", "--max-num-seqs", "8", "--max-model-len", "256"]) == 0
    report = json.loads(out.read_text())
    assert report["server_errors"] == 0 and report["unexpected"] == {}
    assert report["idle_running"] == 0 and report["idle_kv_cache_usage"] == 0
    kinds = {key.split(" -> ")[0] for key in report["by_kind"]}
    assert kinds == set(EXPECTED), kinds  # every kind of client ran
    assert report["health_s"]["non_200"] == 0 and report["rss_bytes"]["max"] > 0
