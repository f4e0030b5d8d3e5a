"""SamplingParams: how to pick tokens and when to stop (vLLM's names and defaults)."""

from __future__ import annotations

import dataclasses
import functools

from paged.structured_outputs import StructuredOutputsParams

# Must match paged.sampler.MAX_LOGPROBS (kept here so validating params does not import jax).
MAX_LOGPROBS = 20

# OpenAI's range for a bias; vLLM's server enforces the same.
MAX_LOGIT_BIAS = 100.0


class InvalidParameter(ValueError):
    """A request parameter this engine cannot take; `field` names it (the server's 400 names it too)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class InvalidTokenIds(InvalidParameter):
    """Token ids outside the model's vocabulary; `field` names the parameter that holds them."""


INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: anything smaller rounds towards 0


@dataclasses.dataclass
class SamplingParams:
    """Sampling and stopping controls for one request.

    temperature 0 is greedy. top_k 0 or -1 disables top-k. Filters apply in this order on the
    temperature-scaled distribution: min_p (relative to the most likely token), then top_k, then top_p on
    what remains (renormalised).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # token id -> bias added to its logit before penalties and sampling (-100 bans it in practice, 100
    # all but forces it), as OpenAI's and vLLM's logit_bias.
    logit_bias: dict[int, float] | None = None
    # A JSON schema, regex, choice list or grammar the output must match (paged/structured_outputs.py).
    structured_outputs: StructuredOutputsParams | None = None
    # The constraint applies from the token after the output first holds this text (a reasoning model's end
    # of thinking, `</think>`: the server sets it from --reasoning-parser, so the grammar shapes the answer
    # and not the thinking). None: from the first token.
    structured_outputs_after: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        self.validate()

    def validate(self) -> None:
        """Raises InvalidParameter (a ValueError) naming the first invalid field and its value; the message
        starts with the field's name."""
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise InvalidParameter(message.split(" ", 1)[0].rstrip(","), message)

        check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        check(self.structured_outputs_after is None or (isinstance(self.structured_outputs_after, str)
                                                        and 0 < len(self.structured_outputs_after) <= 64),
              f"structured_outputs_after must be None or a string of 1 to 64 characters, got "
              f"{self.structured_outputs_after!r}")
        # Every per-row value rides in an int32 or float32 array of the step (paged/batch.py): bounded by it.
        check(_is_number(self.temperature) and 0 <= self.temperature <= FLOAT32_MAX,
              f"temperature must be a finite number >= 0, got {self.temperature!r}")
        check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and 0 <= self.top_k <= INT32_MAX,
              f"top_k must be 0 or -1 (disabled) or a positive integer below 2**31, got {self.top_k!r}")
        check(_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**32),
              f"seed must be None or an integer in [0, 2**32), got {self.seed!r}")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              f"max_tokens must be None or an integer >= 1, got {self.max_tokens!r}")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
              f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        check(all(isinstance(s, str) and s for s in self.stop),
              f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
              f"stop_token_ids must be non-negative integers, got {self.stop_token_ids[:8]!r}")
        check(_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        check(_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        check(_is_number(self.repetition_penalty) and FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX,
              f"repetition_penalty must be a positive float32 (in [{FLOAT32_TINY:g}, {FLOAT32_MAX:g}]), got "
              f"{self.repetition_penalty!r}")
        check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
              f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        for token, bias in self.logit_bias.items():
            check(isinstance(token, int) and not isinstance(token, bool) and token >= 0,
                  f"logit_bias keys must be non-negative token ids, got {token!r}")
            check(_is_number(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                  f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                  f"got {bias!r} for token {token}")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs must be None or a StructuredOutputsParams, got "
              f"{type(self.structured_outputs).__name__}")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        check(self.prompt_logprobs is None
              or (isinstance(self.prompt_logprobs, int) and not isinstance(self.prompt_logprobs, bool)
                  and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
              f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")

    def check_limits(self, config) -> None:
        """Raises InvalidParameter where the request lists more than the engine's limits (`EngineConfig`'s
        max_stop_strings, max_stop_string_chars, max_stop_token_ids, max_logit_bias_entries) allow."""
        def within(field: str, count: int, limit: int, what: str, flag: str) -> None:
            if count > limit:
                raise InvalidParameter(field, f"{field} may hold at most {limit} {what}, got {count} "
                                              f"(the server's --{flag} raises the limit)")
        within("stop", len(self.stop), config.max_stop_strings, "strings", "max-stop-strings")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > config.max_stop_string_chars:
            raise InvalidParameter("stop", f"stop strings may be at most {config.max_stop_string_chars} characters "
                                           f"long each, got one of {longest} (the server's --max-stop-string-chars "
                                           "raises the limit)")
        within("stop_token_ids", len(self.stop_token_ids), config.max_stop_token_ids, "ids", "max-stop-token-ids")
        within("logit_bias", len(self.logit_bias), config.max_logit_bias_entries, "entries",
               "max-logit-bias-entries")

    def check_vocab(self, vocab_size: int) -> None:
        """Raises InvalidTokenIds if stop_token_ids or logit_bias name ids outside [0, vocab_size)."""
        for field, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias)):
            outside = sorted(t for t in ids if t >= vocab_size)
            if outside:
                raise InvalidTokenIds(field, f"{field} names token ids {outside[:5]} outside the vocabulary "
                                             f"[0, {vocab_size})")

    @functools.cached_property
    def stop_token_id_set(self) -> frozenset[int]:
        """stop_token_ids as a set: the output processor checks every generated token against it."""
        return frozenset(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
