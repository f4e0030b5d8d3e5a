"""What a pooling request asks for (`PoolingParams`) and how a model pools (`PoolerConfig`), as vLLM spells them.

A pooling model reads a whole prompt in one step and returns one vector per prompt instead of sampling: the
hidden states of its tokens reduced to one (the last token's, their mean, or the first, CLS, token's),
optionally normalised and truncated to fewer dimensions (Matryoshka), or passed through the model's
classification head.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from paged.config import json_object
from paged.sampling_params import InvalidParameter

POOLING_TYPES = ("LAST", "MEAN", "CLS")
POOLING_TASKS = ("embed", "classify", "score", "encode")


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """How the model pools; unset fields come from the checkpoint (sentence-transformers' modules.json and
    1_Pooling/config.json), then from the architecture (decoders: LAST, encoders: CLS).

    pooling_type: "LAST", "MEAN" or "CLS".
    use_activation: embeddings are scaled to unit length, classifier scores pass through the head's activation
      (a sigmoid for one label, else a softmax). Default: yes, but for a sentence-transformers checkpoint
      without a Normalize module, whose embeddings are not normalised. (vLLM's current name; its former
      `normalize` is read as this.)
    dimensions: embeddings are truncated to this many leading dimensions unless a request asks otherwise.
    """

    pooling_type: str | None = None
    use_activation: bool | None = None
    dimensions: int | None = None

    @classmethod
    def parse(cls, value: "PoolerConfig | dict | str | None") -> "PoolerConfig":
        """From a PoolerConfig, a dict or its JSON text (the command line's `--pooler-config`)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        value = json_object(value, "pooler_config")
        known = {f.name for f in dataclasses.fields(cls)}
        value = _renamed_normalize(value)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown pooler_config field(s) {', '.join(unknown)}; the fields are "
                             f"{', '.join(sorted(known))}")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        if self.pooling_type is not None and str(self.pooling_type).upper() not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.use_activation not in (None, True, False):
            raise ValueError(f"use_activation must be true, false or unset, got {self.use_activation!r}")

    def merged(self, defaults: "PoolerConfig") -> "PoolerConfig":
        """These settings, with `defaults`' where these are unset."""
        return PoolerConfig(**{f.name: getattr(self, f.name) if getattr(self, f.name) is not None
                               else getattr(defaults, f.name) for f in dataclasses.fields(self)})


@dataclasses.dataclass(frozen=True)
class PoolingModel:
    """What a request's pooling options are checked against: the model's `task` ("embed" or "classify"), its
    hidden size and whether its checkpoint allows Matryoshka truncation; `name` for the messages."""

    name: str
    task: str
    hidden_size: int
    matryoshka: bool

    def resolve(self, params: "PoolingParams") -> "PoolingParams":
        """`params` with its task settled (the model's, for none or "encode"); raises InvalidParameter for what
        this model cannot do (vLLM's messages)."""
        task = params.task if params.task not in (None, "encode") else self.task
        if task in ("classify", "score") and self.task != "classify":
            raise InvalidParameter("task", f"{self.name} is an embedding model; it has no classifier head")
        if task == "embed" and self.task != "embed":
            raise InvalidParameter("task", f"{self.name} is a classifier; it returns scores, not embeddings")
        dimensions = params.dimensions
        if dimensions is not None:
            if self.task != "embed":
                raise InvalidParameter("dimensions", "dimensions applies to embeddings; this model is a classifier")
            if not self.matryoshka:
                raise InvalidParameter("dimensions", f"model {self.name!r} does not support Matryoshka embeddings; "
                                       f"dimensions must be unset (received dimensions={dimensions})")
            if dimensions > self.hidden_size:
                raise InvalidParameter("dimensions", f"model {self.name!r} only supports dimensions in range "
                                       f"[1, {self.hidden_size}], got {dimensions}")
        return dataclasses.replace(params, task=task)


@dataclasses.dataclass
class PoolingParams:
    """Per-request pooling options (vLLM's PoolingParams).

    dimensions: truncate the embedding to its first `dimensions` values (Matryoshka models), then normalise.
    use_activation: normalise the embedding, or apply the classifier's activation (default: the model's
      pooler config). `normalize`, vLLM's former name for it, is accepted.
    truncate_prompt_tokens: keep only the prompt's last k tokens (-1: as many as the model takes).
    task: what the vector is for ("embed", "classify", "score", "encode"); set by the API called.
    """

    dimensions: int | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None
    normalize: dataclasses.InitVar[bool | None] = None

    def __post_init__(self, normalize: bool | None) -> None:
        if normalize is not None and self.use_activation is None:
            self.use_activation = normalize

    def validate(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidParameter("dimensions", f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.use_activation not in (None, True, False):
            raise InvalidParameter("use_activation",
                                   f"use_activation must be true, false or null, got {self.use_activation!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1)):
            raise InvalidParameter("truncate_prompt_tokens",
                                   f"truncate_prompt_tokens must be -1 or a positive integer, got {k!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise InvalidParameter("task", f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")

    def with_defaults(self, **defaults: Any) -> "PoolingParams":
        """A copy with unset fields taken from `defaults`."""
        return dataclasses.replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})


def _renamed_normalize(settings: dict) -> dict:
    """vLLM's former `normalize` as today's `use_activation`."""
    if "normalize" not in settings:
        return settings
    settings = dict(settings)
    normalize = settings.pop("normalize")
    if settings.get("use_activation") is None:
        settings["use_activation"] = normalize
    return settings
