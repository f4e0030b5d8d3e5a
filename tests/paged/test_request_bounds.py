"""Every numeric field a request brings is bounded by the array it rides in: derived from the step's own
arrays, so a new field cannot forget its bound. A value either is refused with ValueError up front, or
fills its row of the step unchanged (no overflow, no wrap, no inf from a finite input)."""

from __future__ import annotations

import dataclasses

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
    """Row 0 of every per-row array of the step."""
    arrays = {f"sampling.{k}": v for k, v in vars(inputs.sampling).items()}
    return {k: np.asarray(v)[0] for k, v in arrays.items()}


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
