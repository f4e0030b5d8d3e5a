"""Speculative decoding's settings as vLLM spells them (`speculative_config`), and the n-gram proposer.

`SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})` checks a
configuration the way vLLM does: `method` is "ngram" (prompt lookup), "draft_model" (a smaller checkpoint
given as `model`), "eagle" or "eagle3" (a head given as `model`); a `model` without a method is a draft model
(or "[ngram]", vLLM's old spelling of prompt lookup).

The n-gram proposer (prompt lookup decoding) needs no model: the last n tokens of a sequence (n from
`prompt_lookup_max` down to `prompt_lookup_min`) are looked up earlier in the same sequence, and the tokens that
followed their latest earlier occurrence are proposed. Outputs that copy from their prompt (a rewrite, a
summary quoting it, code edits) continue what they copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from paged.config import json_object
from paged.request import PLACEHOLDER

SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# vLLM's other methods, named so a configuration asking for one is refused by name.
OTHER_METHODS = ("medusa", "mlp_speculator", "mtp", "deepseek_mtp", "ernie_mtp", "qwen3_next_mtp", "mimo_mtp",
                 "longcat_flash_mtp", "suffix")
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size", "draft_tensor_parallel_size")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # No proposals while this many requests or more run (None: always speculate).
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: "dict | str | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """A configuration from a dict or its JSON text (the CLI's `--speculative-config`); ValueError naming
        what is wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; the keys are {', '.join(_KEYS)}")
        fields: dict[str, Any] = dict(value)
        if fields.pop("draft_tensor_parallel_size", None) not in (None, 1):
            raise ValueError("speculative_config: draft_tensor_parallel_size other than 1 is not supported")
        method, model = fields.get("method"), fields.get("model")
        if method is None or method == "[ngram]":
            if model == "[ngram]" or method == "[ngram]":
                method, model = "ngram", None
            elif model is not None:
                method = "draft_model"
            else:
                raise ValueError("speculative_config needs a method (ngram, draft_model, eagle, eagle3) or a model")
        if method in OTHER_METHODS:
            raise ValueError(f"speculative_config: method {method!r} is not supported; supported: "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: unknown method {method!r}; supported: "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        fields.update(method=method, model=model)
        k = fields.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        if method == "ngram":
            fields.update(_lookup_bounds(fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")))
        else:
            if not model:
                raise ValueError(f"speculative_config: method {method!r} needs a model (the draft's or the head's "
                                 "checkpoint)")
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if fields.get(key) is not None:
                    raise ValueError(f"speculative_config: {key} is for method 'ngram', not {method!r}")
        limit = fields.get("disable_by_batch_size")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 2):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 2, got {limit!r}")
        return cls(**fields)


def max_verify_tokens(speculative: SpeculativeConfig | None, max_num_seqs: int) -> int:
    """The most packed tokens a step verifies: k + 1 for each row that may speculate (fewer than
    disable_by_batch_size rows, when set); 0 without speculation."""
    if speculative is None:
        return 0
    rows = max_num_seqs if speculative.disable_by_batch_size is None else \
        min(max_num_seqs, speculative.disable_by_batch_size - 1)
    return rows * (speculative.num_speculative_tokens + 1)


def _lookup_bounds(low, high) -> dict[str, int]:
    """vLLM's defaults and checks for the n-gram lengths: both 5 when neither is given, else the one given for
    both."""
    if low is None and high is None:
        low = high = 5
    elif low is None:
        low = high
    elif high is None:
        high = low
    for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"speculative_config: {name}={value!r} must be > 0")
    if low > high:
        raise ValueError(f"speculative_config: prompt_lookup_min={low} must be <= prompt_lookup_max={high}")
    return {"prompt_lookup_min": low, "prompt_lookup_max": high}


def propose_ngram(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to `k` tokens proposed for `token_ids` (int [L], the sequence so far): for the longest n in
    [min_n, max_n] whose last-n-token suffix occurred earlier, the tokens that followed its latest earlier
    occurrence (fewer when that occurrence sits near the end; none without a match).

    One pass over the sequence finds where the last token occurred before; each longer n then only checks
    the token before each remaining match (a proposal is computed every step, so this is host time per step).
    """
    length = len(token_ids)
    max_n = min(max_n, length - 1)
    if max_n < min_n:
        return token_ids[:0]
    ends = np.flatnonzero(token_ids[:length - 1] == token_ids[length - 1])  # where earlier n-grams end, ascending
    best_end, n = None, 1
    while ends.size:
        if n >= min_n:
            best_end = ends[-1]  # the latest occurrence of the longest suffix so far
        if n == max_n:
            break
        ends = ends[ends >= n]
        ends = ends[token_ids[ends - n] == token_ids[length - 1 - n]]
        n += 1
    if best_end is None:
        return token_ids[:0]
    return token_ids[best_end + 1:best_end + 1 + k]


def ngram_proposer(config: SpeculativeConfig):
    """The scheduler's `propose(request, limit)` for method "ngram": up to min(k, limit) tokens.

    A request whose last token is still in flight (async scheduling: the step computing it has not been read
    back) is proposed for all the same: the lookup runs on the tokens known, its first token stands for the
    one in flight and the rest are proposed after it. If the token in flight differs, verification rejects
    what does not fit, and the output is unchanged."""
    def propose(request, limit: int) -> list[int]:
        tokens = np.asarray(request.token_ids, np.int64)
        count = min(config.num_speculative_tokens, limit)
        if len(tokens) and tokens[-1] == PLACEHOLDER:
            guessed = propose_ngram(tokens[:-1], config.prompt_lookup_min, config.prompt_lookup_max, count + 1)
            return guessed[1:].tolist()
        return propose_ngram(tokens, config.prompt_lookup_min, config.prompt_lookup_max, count).tolist()
    return propose


@dataclasses.dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters: rows that carried proposals (drafts), proposed and accepted tokens, and
    acceptances by position (index i: proposals whose first i + 1 tokens were all accepted)."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a speculating row produced per step on average (accepted ones plus the target's own)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
