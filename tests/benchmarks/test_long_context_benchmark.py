"""Smoke test of `paged bench long_context` at small sizes (the real run is in docs/performance.md)."""

from __future__ import annotations

import os

from paged.benchmarks.long_context import run_decode, run_prompt
from paged.models.tiny import create_tiny_llama


def test_a_prompt_prefills_in_chunks_and_decodes():
    row = run_prompt(600, 4, 128)
    # ceil(600 / 128) prompt chunks, the three tokens after the first, and a last call that collects the token in
    # flight (async scheduling).
    assert row["steps"] == 5 + 3 + 1
    assert row["time_to_first_token_s"] > 0 and row["decode_tokens_per_s"] > 0
    # One sequence: the pool holds it (and the sink block), nothing like the default budget.
    assert row["kv_blocks"] * 16 >= 604 and row["kv_pool_bytes"] < 8 * 2**20
    assert row["peak_rss_bytes"] >= row["rss_after_engine_bytes"] > 0


def test_decode_after_a_restored_context(tmp_path):
    model = create_tiny_llama(os.path.join(tmp_path, "tiny"), max_position_embeddings=256)
    result = run_decode(model, [40, 700], steps=3, dtype="float32")
    assert result["max_model_len"] == 1024  # YaRN x4 over the checkpoint's 256 positions
    for row, context in zip(result["rows"], [40, 700]):
        assert row["context"] == context
        assert row["generated"] == 5 and row["decode_steps"] == 3
        assert row["median_step_s"] > 0
