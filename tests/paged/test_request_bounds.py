"""Every numeric field a request brings is bounded by the array it rides in: derived from the step's own
arrays, so a new field cannot forget its bound. A value either is refused with ValueError up front, or
fills its row of the step unchanged (no overflow, no wrap, no inf from a finite input)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from paged import LLMEngine, SamplingParams
from paged.batch import prepare_inputs

# Values at and past the edges of int32, uint32, int64 and float32, and the non-finite floats.
EDGES = [2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63, -(2**31) - 1, -1, 3.4e38, 3.5e38, 1e300, float("inf"),
         float("nan"), -3.5e38]
NUMERIC = [f.name for f in dataclasses.fields(SamplingParams)
           if any(t in str(f.type) for t in ("int", "float")) and "list" not in str(f.type)
           and "dict" not in str(f.type)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(tiny_model_dir, show_progress=False, block_size=8, max_model_len=64, max_num_seqs=4,
                     num_kv_blocks=32, compilation_cache_dir=None)


def _rows(inputs) -> dict[str, np.ndarray]:
    """Row 0 of every per-row array of the step; for a row sampled apart (its logits adjusted), its row of the
    adjustments' arrays, and their entries."""
    adj = inputs.adjustments
    if adj is None:
        return {f"sampling.{k}": np.asarray(v)[0] for k, v in vars(inputs.sampling).items()}
    assert adj.rows[0] == 0
    rows = {f"sampling.{k}": np.asarray(v)[0] for k, v in vars(adj.sampling).items()}
    rows |= {k: np.asarray(getattr(adj, k))[0] for k in ("presence_penalty", "frequency_penalty",
                                                          "repetition_penalty")}
    return rows | {k: np.asarray(getattr(adj, k)) for k in ("entry_tokens", "entry_bias", "entry_counts")}


@pytest.mark.parametrize("field", NUMERIC)
@pytest.mark.parametrize("value", EDGES, ids=[repr(v) for v in EDGES])
def test_a_value_is_refused_or_fits_its_array(engine, field, value):
    base = dict(max_tokens=4)
    if field == "min_tokens":
        base["max_tokens"] = None
    try:
        params = SamplingParams(**{**base, field: value})
        parent = engine.make_request("bounds", None, [1, 2, 3], params)
    except (ValueError, NotImplementedError):
        return  # refused up front, before any step
    engine.add_request(parent)
    try:
        batch = engine.scheduler.schedule()
        inputs = prepare_inputs(batch, engine.block_manager, engine.buckets)  # must not overflow
        for name, row in _rows(inputs).items():
            if row.dtype.kind == "f":
                assert np.all(np.isfinite(row) | np.isneginf(row)), (name, row)  # -inf: banned ids only
        rows = _rows(inputs)
        for array_name, param_value in (("sampling.temperature", params.temperature),
                                        ("sampling.top_k", params.top_k), ("sampling.top_p", params.top_p),
                                        ("sampling.min_p", params.min_p),
                                        ("sampling.seeds", parent.children[0].seed)):
            assert rows[array_name].item() == pytest.approx(param_value, rel=1e-6), (array_name, param_value)
    finally:
        engine.abort_request("bounds")


@pytest.fixture(scope="module")
def limited_llm(tiny_model_dir):
    from paged import LLM
    return LLM(tiny_model_dir, block_size=8, max_model_len=64, max_num_seqs=2, num_kv_blocks=32,
               compilation_cache_dir=None, show_progress=False, max_stop_strings=2, max_stop_string_chars=8,
               max_stop_token_ids=3, max_logit_bias_entries=4)


@pytest.mark.parametrize("kwargs, field, message", [
    (dict(stop=["a", "b", "c"]), "stop", "at most 2 strings, got 3 (the server's --max-stop-strings"),
    (dict(stop="x" * 9), "stop", "at most 8 characters long each, got one of 9"),
    (dict(stop_token_ids=[1, 2, 3, 4]), "stop_token_ids", "at most 3 ids, got 4"),
    (dict(logit_bias={1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}), "logit_bias", "at most 4 entries, got 5"),
])
def test_list_limits_are_the_engines_and_can_be_raised(limited_llm, kwargs, field, message):
    """What a request may list is bounded by the engine's options (the server's flags): over them is an
    InvalidParameter naming the field, the limit and the flag; at them the request runs."""
    from paged.sampling_params import InvalidParameter
    with pytest.raises(InvalidParameter) as caught:
        limited_llm.engine.make_request("over", "Hello", None, SamplingParams(max_tokens=2, **kwargs))
    assert caught.value.field == field and message in str(caught.value)
    with pytest.raises(ValueError, match=re.escape(message)):
        limited_llm.generate("Hello", SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
    assert not limited_llm.engine.has_unfinished_requests()
    at_limit = {"stop": ["a", "b"], "stop_token_ids": [1, 2, 3], "logit_bias": {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}}
    value = at_limit.get(field) if "characters" not in message else "x" * 8
    out = limited_llm.generate("Hello", SamplingParams(max_tokens=2, **{field: value}), use_tqdm=False)
    assert out[0].outputs[0].finish_reason in ("length", "stop")
