"""Scoring pairs of texts, one way for `LLM.score` and the server's /score and /rerank: which pairs a call
makes, how a cross-encoder reads a pair, and how an embedding model scores one."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """(data_1, data_2) as vLLM pairs them: one text against each of many (1 -> N), or one to one (N -> N)."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    if not first or not second:
        raise ValueError("nothing to score: both sides need at least one text")
    if not all(isinstance(t, str) for t in (*first, *second)):
        raise ValueError("scores are computed between texts (strings)")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"data_1 has {len(first)} texts and data_2 {len(second)}: give one data_1, or as many "
                         "as data_2")
    return list(zip(first, second))


def pair_encoding(tokenizer, first: str, second: str) -> dict:
    """A cross-encoder's input for one pair: the tokenizer's pair encoding ([CLS] a [SEP] b [SEP] for BERT),
    its input_ids and, where the tokenizer makes them, token_type_ids."""
    try:
        encoded = tokenizer(first, second)
    except Exception as exc:  # noqa: BLE001 - the tokenizer's refusal of the caller's text
        raise ValueError(f"the pair could not be tokenized: {type(exc).__name__}: {exc}") from None
    return {key: list(encoded[key]) for key in ("input_ids", "token_type_ids") if key in encoded}


def cosine(a, b) -> float:
    """Cosine similarity of two vectors, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))
