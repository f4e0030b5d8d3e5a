"""speculative_config as vLLM checks it, and the n-gram proposer against a plain search over every position."""

from __future__ import annotations

import numpy as np
import pytest

from paged.speculative import SpeculativeConfig, propose_ngram


def test_ngram_lookup_bounds_default_as_vllms():
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    one = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}')
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (4, 4)
    legacy = SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (legacy.method, legacy.model, legacy.prompt_lookup_max) == ("ngram", None, 2)
    draft = SpeculativeConfig.parse({"model": "/models/small", "num_speculative_tokens": 4})
    assert (draft.method, draft.model) == ("draft_model", "/models/small")
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("value, message", [
    ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min=0 must be > 0"),
    ({"method": "medusa", "model": "x", "num_speculative_tokens": 2}, "method 'medusa' is not supported"),
    ({"method": "guess", "num_speculative_tokens": 2}, "unknown method 'guess'"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "needs a model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "temperature": 1}, "unknown key"),
    ({"num_speculative_tokens": 2}, "needs a method"),
    ("{not json", "must be a JSON object"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "prompt_lookup_max is for method 'ngram'"),
], ids=lambda v: str(v)[:40])
def test_what_is_wrong_is_named(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def _reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest n in [min_n, max_n] (and < len) whose suffix occurs earlier; what follows its latest
    earlier start, found by comparing lists at every position."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        latest = None
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                latest = start
        if latest is not None:
            return tokens[latest + n:latest + n + k]
    return []


def test_ngram_proposals_equal_a_plain_search():
    rng = np.random.default_rng(0)
    for _ in range(500):
        tokens = rng.integers(0, int(rng.integers(2, 6)), size=int(rng.integers(1, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        k = int(rng.integers(1, 6))
        got = propose_ngram(np.asarray(tokens, np.int64), min_n, max_n, k).tolist()
        assert got == _reference(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_a_copied_span_is_continued():
    prompt = [7, 8, 9, 10, 11, 12, 3, 4]
    assert propose_ngram(np.asarray(prompt + [8, 9]), 2, 3, 3).tolist() == [10, 11, 12]
    assert propose_ngram(np.asarray([1, 2, 3]), 1, 2, 4).tolist() == []  # nothing repeats
