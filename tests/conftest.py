"""Shared fixtures: tiny checkpoints built on the fly (no downloads)."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from paged.models.tiny import create_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama written by our own code (no torch needed)."""
    return create_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    from paged import LLM
    return LLM(tiny_model_dir, block_size=8, max_num_seqs=16, max_num_batched_tokens=128, max_model_len=256,
               show_progress=False)
