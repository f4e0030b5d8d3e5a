"""The prepared GPU run's verdicts (benchmarks/gpu_check.py): how it compares greedy runs and picks "auto"."""

from __future__ import annotations

import types

from paged.benchmarks.gpu_check import _compare, fastest_at_goal


def completion(tokens, top5):
    """A completion's token ids and, per position, its top-5 logprobs (token id -> logprob)."""
    return types.SimpleNamespace(token_ids=tokens, logprobs=[{t: -1.0 for t in top} for top in top5])


def test_compare_tells_exact_near_tie_and_divergence_apart():
    expected = completion([5, 6, 7], [[5, 9], [6, 8], [7]])
    assert _compare(completion([5, 6, 7], [[5], [6], [7]]), expected) == "exact"
    # Position 1: each run's token is among the other's top 5.
    assert _compare(completion([5, 8, 1], [[5], [8, 6], [1]]), expected) == "near-tie at 1"
    # 8 is in the expected run's top 5 there, but 6 is not in this run's: a real divergence.
    assert _compare(completion([5, 8, 1], [[5], [8, 2], [1]]), expected) == "diverged at 1"
    assert _compare(completion([5, 6], [[5], [6]]), expected).startswith("diverged in length")


def decode_row(batch, context, seconds, dtype="bfloat16"):
    return dict(kind="decode", batch=batch, context=context, dtype=dtype,
                results={name: dict(seconds=s, fraction_of_copy=1e-3 / s) for name, s in seconds.items()})


def test_auto_should_pick_the_kernel_fastest_at_most_goal_shapes():
    sweep = dict(rows=[
        decode_row(32, 2048, {"pallas": 2.0, "pallas-mosaic": 1.0, "xla": 3.0, "jax-pallas-ops": 0.5}),
        decode_row(128, 8192, {"pallas": 2.0, "pallas-mosaic": 1.5, "xla": 3.0}),
        decode_row(64, 4096, {"pallas": 1.0, "pallas-mosaic": 1.5, "xla": 3.0}),
        decode_row(8, 2048, {"xla": 0.1}),  # below the goal's batch: not counted
        decode_row(32, 512, {"xla": 0.1}),  # below the goal's context
        decode_row(32, 2048, {"xla": 0.1}, dtype="float32"),
        dict(kind="prefill", batch=32, context=2048, dtype="bfloat16", results={"xla": dict(seconds=0.1)}),
    ])
    goal = fastest_at_goal(sweep)
    # JAX's kernel is a baseline, not a backend the engine can name: it never wins "auto".
    assert goal["wins"] == {"pallas-mosaic": 2, "pallas": 1}
    assert goal["auto_should_pick"] == "pallas-mosaic"
    assert goal["fraction_of_copy"]["jax-pallas-ops"]["max"] == 1e-3 / 0.5
    assert goal["fraction_of_copy"]["pallas"] == dict(min=1e-3 / 2.0, median=1e-3 / 2.0, max=1e-3 / 1.0)
    assert fastest_at_goal(dict(rows=[]))["auto_should_pick"] is None


def test_the_profile_program_runs_each_named_kernel(monkeypatch, capsys):
    from paged.benchmarks import gpu_profile
    monkeypatch.setattr("sys.argv", ["gpu_profile.py", "--batch", "2", "--context", "32", "--calls", "1",
                                     "--only", "xla", "pallas"])
    assert gpu_profile.main() == 0
    err = capsys.readouterr().err
    assert "pallas: 1 calls" in err and "xla: 1 calls" in err and "cpu" not in err


def step(read_back_at, prefill, context, rows=2):
    return types.SimpleNamespace(read_back_at=read_back_at, prefill_tokens=(prefill,) + (0,) * (rows - 1),
                                 context_tokens=context, request_ids=tuple(range(rows)))


def test_decode_steps_time_each_decode_step_against_its_byte_floor():
    from paged.benchmarks.gpu_throughput import decode_steps
    records = [step(0.0, 16, 20), step(1.0, 0, 22),  # after a prompt step: its gap is not a decode step's
               step(1.5, 0, 24), step(2.5, 0, 26), step(3.0, 4, 30), step(3.2, 0, 32), step(None, 0, 34)]
    # Decode steps after decode steps: gaps 0.5 s (context 24), 1.0 s (26); after the prompt step, none.
    got = decode_steps(records, weight_bytes=1000, kv_bytes_per_token=10, copy_bytes_per_s=100.0)
    floors = [(1000 + 24 * 10) / 100.0, (1000 + 26 * 10) / 100.0]
    assert got["steps"] == 2 and got["median_batch"] == 2
    assert got["median_step_s"] == 0.75 and got["median_floor_s"] == sum(floors) / 2
    assert abs(got["median_over_floor"] - (0.5 / floors[0] + 1.0 / floors[1]) / 2) < 1e-12
    assert decode_steps(records[:2], 1000, 10, 100.0) == {"steps": 0}


def test_the_throughput_section_runs_a_shape_to_its_end(tmp_path):
    """On CPU, a tiny Llama's config with dummy weights: every output token made, the K/V bytes a token holds
    as its config says (2 x layers x KV heads x head_dim x 2 bytes), nothing compiled in the timed run."""
    import time
    from paged.benchmarks.gpu_throughput import run_shape, summary_line
    from paged.models.tiny import create_tiny_llama
    directory = create_tiny_llama(str(tmp_path / "tiny"), hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    stages = []
    entry = run_shape(directory, "tiny", requests=4, prompt_len=12, output_len=6, copy_bytes_per_s=1e10,
                      deadline=time.monotonic() + 600, progress=lambda e: stages.append(sorted(e)))
    assert entry["output_tokens"] == 4 * 6 and "cut_short" not in entry
    # What a run killed mid-way keeps: the engine's figures after start-up, the warm-up's decode steps after it.
    assert len(stages) == 2 and "weight_bytes" in stages[0] and "warmup_decode" in stages[1]
    assert entry["warmup_decode"]["steps"] > 0
    assert entry["kv_bytes_per_token"] == 2 * 2 * 2 * (128 // 4) * 2
    assert entry["compilations_in_timed_run"] == 0 and entry["decode"]["steps"] > 0
    assert "output tok/s" in summary_line(entry)
    cut = run_shape(directory, "tiny", requests=4, prompt_len=12, output_len=6, copy_bytes_per_s=1e10,
                    deadline=time.monotonic())
    assert cut["cut_short"] == "during the warm-up" and "nothing timed" in summary_line(cut)


def test_the_prepared_run_ends_with_the_throughput_section(tmp_path):
    """The script as the device runs it (on CPU its dry run: a tiny Llama), the other sections skipped: the
    section's entry lands in gpu_check.json and its line in the summary."""
    import json
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", str(tmp_path), "--budget-s", "300",
                           "--skip", "correctness", "engine", "sweep"], cwd=repo, capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    (entry,) = report["throughput"]
    assert entry["shape"] == "tiny" and entry["output_tokens"] == 8 * 8 and entry["copy_bytes_per_s"] > 0
    assert any(line.startswith("throughput tiny (8 x 24+8, ") for line in report["summary"])
