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
