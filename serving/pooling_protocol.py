"""Request bodies of the pooling routes (serving/pooling.py), as OpenAI's embeddings API and vLLM's /pooling,
/classify, /score and /rerank (with the Jina / Cohere spellings vLLM accepts) take them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from paged import PoolingParams

_STRICT = ConfigDict(extra="ignore", strict=True)

# One text, a batch of texts, one prompt's token ids, or a batch of those.
PromptInput = str | list[str] | list[int] | list[list[int]]


class _Pooled(BaseModel):
    """What every pooling route takes beside its inputs."""

    model_config = _STRICT
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    use_activation: bool | None = None
    normalize: bool | None = None  # vLLM's former name for use_activation

    def pooling_params(self, task: str, dimensions: int | None = None) -> PoolingParams:
        use_activation = self.use_activation if self.use_activation is not None else self.normalize
        return PoolingParams(dimensions=dimensions, use_activation=use_activation,
                             truncate_prompt_tokens=self.truncate_prompt_tokens, task=task)


class EmbeddingRequest(_Pooled):
    """POST /v1/embeddings (and /pooling, whose reply carries the raw vectors under `data`): `input`, or vLLM's
    chat form, `messages` rendered by the model's chat template."""

    input: PromptInput | None = None
    messages: list[dict] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    add_generation_prompt: bool = False

    @model_validator(mode="after")
    def _input_or_messages(self):
        if (self.input is None) == (self.messages is None):
            raise ValueError("give either input or messages")
        return self


class ClassificationRequest(_Pooled):
    """POST /classify"""

    input: PromptInput


class ScoreRequest(_Pooled):
    """POST /score (and /v1/score): one text against many, or pairwise. Its sides are named as in vLLM's
    current API (queries / documents), or its earlier one (text_1 / text_2, data_1 / data_2)."""

    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None

    @model_validator(mode="after")
    def _one_pair_of_sides(self):
        given = [(a, b) for a, b in (("queries", "documents"), ("text_1", "text_2"), ("data_1", "data_2"))
                 if getattr(self, a) is not None or getattr(self, b) is not None]
        if len(given) != 1 or any(getattr(self, side) is None for side in given[0]):
            raise ValueError("give the two sides to score as queries and documents (or text_1 and text_2)")
        return self

    def sides(self) -> tuple[str | list[str], str | list[str]]:
        for a, b in (("queries", "documents"), ("text_1", "text_2"), ("data_1", "data_2")):
            if getattr(self, a) is not None:
                return getattr(self, a), getattr(self, b)
        raise AssertionError("validated")


class RerankRequest(_Pooled):
    """POST /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's shape): documents ranked by relevance."""

    query: str
    documents: list[str]
    top_n: int = Field(0, ge=0)  # 0: all
    return_documents: bool = True
