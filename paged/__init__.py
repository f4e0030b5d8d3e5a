"""paged: a paged-attention LLM inference engine in JAX."""

import importlib.util as _importlib_util
import os as _os

# paged uses transformers for tokenizers and configs only: without torch (the runtime install), its import-time
# advice that "models won't be available" is about models paged does not take from it. Set the variable
# yourself to keep transformers' advisory warnings either way.
if _importlib_util.find_spec("torch") is None:
    _os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from paged import _source_tree

_source_tree.register()  # a checkout that was never installed: paged.models etc. from their folders

from paged.models.attention import AttentionMetadata, register_attention_backend
from paged.models.base import PagedModel
from paged.models.registry import register_model
from paged.engine import EngineBrokenError, LLMEngine, StepFailedError
from paged.config import EngineConfig
from paged.llm import LLM
from paged.lora import LoRARequest
from paged.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput,
                           EmbeddingRequestOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput,
                           ScoringOutput, ScoringRequestOutput)
from paged.pooling_params import PoolerConfig, PoolingParams
from paged.sampling_params import InvalidParameter, InvalidTokenIds, SamplingParams
from paged.structured_outputs import InvalidStructuredOutput, StructuredOutputsParams
from paged.startup import configure_default_logging

configure_default_logging()

__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "AttentionMetadata", "ClassificationOutput", "ClassificationRequestOutput",
           "CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "EngineBrokenError", "EngineConfig",
           "InvalidParameter", "InvalidStructuredOutput", "InvalidTokenIds", "Logprob", "LoRARequest", "PoolerConfig",
           "PagedModel", "PoolingOutput", "PoolingParams", "PoolingRequestOutput", "RequestOutput", "SamplingParams",
           "ScoringOutput", "ScoringRequestOutput", "StepFailedError", "StructuredOutputsParams",
           "register_attention_backend", "register_model", "__version__"]
