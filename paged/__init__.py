"""paged: a paged-attention LLM inference engine in JAX."""

from paged.engine import EngineBrokenError, LLMEngine, StepFailedError
from paged.config import EngineConfig
from paged.llm import LLM
from paged.outputs import CompletionOutput, Logprob, RequestOutput
from paged.sampling_params import InvalidTokenIds, SamplingParams
from paged.structured_outputs import InvalidStructuredOutput, StructuredOutputsParams
from paged.startup import configure_default_logging

configure_default_logging()

__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "CompletionOutput", "EngineBrokenError", "EngineConfig", "InvalidStructuredOutput",
           "InvalidTokenIds", "Logprob", "RequestOutput", "SamplingParams", "StepFailedError",
           "StructuredOutputsParams", "__version__"]
