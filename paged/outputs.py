"""What `LLM.generate` returns, shaped like vLLM's outputs."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Logprob:
    """Log-probability of one token under the model's raw distribution, its rank (1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per token: the sampled token and the top-k
    # LLM.chat with a reasoning_parser: the thinking (None: it wrote none) and the answer, split from `text`.
    reasoning_content: str | None = None
    content: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Timestamps (time.monotonic()) of a request's life; for n > 1, of its first sequence."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt token
    # {token id: Logprob} holding that token and the top prompt_logprobs (vLLM's layout).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


# ---- pooling models (vLLM's output classes) ------------------------------------------------------------


@dataclasses.dataclass
class PoolingOutput:
    """A pooling model's vector for one prompt: float32 [D] (an embedding, or a classifier's scores)."""

    data: Any


@dataclasses.dataclass
class PoolingRequestOutput:
    """What `LLM.encode` returns per prompt; `outputs` is a PoolingOutput (or, from `embed`, `classify` and
    `score`, the EmbeddingOutput, ClassificationOutput or ScoringOutput built from it)."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    task: str | None = None  # embed, classify or score


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class ClassificationOutput:
    probs: list[float]  # per label (the raw logits when the activation is turned off)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class ScoringOutput:
    score: float


def _retyped(cls, output: PoolingRequestOutput, outputs):
    """`output` as one of its typed subclasses, with `outputs` in place of its PoolingOutput."""
    return cls(**{**vars(output), "outputs": outputs})


@dataclasses.dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return _retyped(cls, output, EmbeddingOutput(output.outputs.data.tolist()))


@dataclasses.dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return _retyped(cls, output, ClassificationOutput(output.outputs.data.tolist()))


@dataclasses.dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput, score: float) -> "ScoringRequestOutput":
        return _retyped(cls, output, ScoringOutput(float(score)))
