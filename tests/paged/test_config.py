"""Engine options are defined once (paged.EngineConfig) and every front end takes all of them."""

from __future__ import annotations

import dataclasses

import pytest

import paged.llm
from paged import LLM
from paged.config import EngineConfig, engine_kwargs_from_cli_args
from paged.serving.cli import build_parser


def _other_value(field: dataclasses.Field):
    """A valid value different from the field's default, derived from the field itself."""
    kind = str(field.type)
    if field.metadata["choices"]:
        return next(c for c in field.metadata["choices"] if c != field.default)
    if kind.startswith("bool"):
        return not field.default
    if kind.startswith("int"):
        return (field.default or 0) + 2
    if kind.startswith("float"):
        return (field.default or 0.0) / 2 + 0.25
    return "/tmp/some-dir" if field.default == "auto" else "some-value"


def _cli_tokens(field: dataclasses.Field, value) -> list[str]:
    flag = "--" + field.name.replace("_", "-")
    if isinstance(value, bool):
        return [flag] if value else ["--no-" + flag[2:]]
    return [flag, str(value)]


FIELDS = dataclasses.fields(EngineConfig)


@pytest.mark.parametrize("field", FIELDS, ids=[f.name for f in FIELDS])
def test_every_option_reaches_the_engine_from_llm(monkeypatch, field):
    seen = {}

    class Recorder:
        def __init__(self, model, show_progress=True, **options):
            seen.update(options, model=model)

    monkeypatch.setattr(paged.llm, "LLMEngine", Recorder)
    value = _other_value(field)
    # An LLM is one data-parallel replica: several replicas need its rank.
    companion = {"data_parallel_size": {"data_parallel_rank": 0}}.get(field.name, {})
    LLM("some-model", **{field.name: value}, **companion)
    assert seen[field.name] == value and seen["model"] == "some-model"


# `paged generate` runs one engine (no replicas); `paged serve` runs every replica, so it sets each one's rank.
NOT_FLAGS = {"generate": {"data_parallel_size", "data_parallel_rank"}, "serve": {"data_parallel_rank"}}


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("field", FIELDS, ids=[f.name for f in FIELDS])
def test_every_option_is_a_flag_of_generate_and_serve(command, field):
    value = _other_value(field)
    extra = ["a prompt"] if command == "generate" else []
    if field.name in NOT_FLAGS[command]:
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, *_cli_tokens(field, value), *extra])
        return
    args = build_parser().parse_args([command, *_cli_tokens(field, value), *extra])
    options = engine_kwargs_from_cli_args(args)
    assert set(options) == {f.name for f in FIELDS} - NOT_FLAGS[command]
    assert options[field.name] == value
    defaults = {f.name: f.default for f in FIELDS if f.name != field.name and f.name not in NOT_FLAGS[command]}
    assert {k: v for k, v in options.items() if k != field.name} == defaults


def test_legacy_negative_flags_still_work():
    args = build_parser().parse_args(["serve", "--no-prefix-caching", "--no-chunked-prefill",
                                      "--no-async-scheduling", "--compilation-cache-dir", "none"])
    options = engine_kwargs_from_cli_args(args)
    assert options["enable_prefix_caching"] is options["enable_chunked_prefill"] is False
    assert options["async_scheduling"] is False and options["compilation_cache_dir"] is None


def test_serve_takes_the_model_as_a_positional_argument():
    from paged.serving.cli import _model
    assert _model(build_parser().parse_args(["serve", "org/some-model", "--port", "9"])) == "org/some-model"
    assert _model(build_parser().parse_args(["serve", "--model", "org/other"])) == "org/other"
    with pytest.raises(ValueError, match="two models"):
        _model(build_parser().parse_args(["serve", "org/a", "--model", "org/b"]))


def test_unknown_option_is_a_clear_error():
    with pytest.raises(TypeError, match="max_num_seq.*EngineConfig"):
        LLM("some-model", max_num_seq=4)


def test_bench_throughput_takes_every_engine_option():
    """`paged bench throughput` takes the same flags; its --seed seeds the workload and the engine alike, and
    it runs every data-parallel replica, as `paged serve` does."""
    from paged.benchmarks.throughput import build_parser as bench_parser
    options = engine_kwargs_from_cli_args(bench_parser().parse_args(["--max-num-seqs", "8"]))
    assert set(options) == {f.name for f in FIELDS} - NOT_FLAGS["serve"]
    assert options["max_num_seqs"] == 8 and options["enable_prefix_caching"] is False
