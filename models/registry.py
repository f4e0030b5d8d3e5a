"""Maps Hugging Face `architectures` names to our implementations."""

from __future__ import annotations

from paged.models.bert import BertModel
from paged.models.gpt2 import GPT2LMHeadModel
from paged.models.llama import LlamaForCausalLM

_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "Gemma2ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": LlamaForCausalLM,
    "GlmForCausalLM": LlamaForCausalLM,
    "Glm4ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
}

# Architectures that only pool (`runner="pooling"`): decoders saved without their LM head, as
# sentence-transformers saves them (Qwen3-Embedding, gte-Qwen2), encoders, and sequence classifiers.
_POOLING = {
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": LlamaForCausalLM,
    "Qwen2Model": LlamaForCausalLM,
    "Qwen3Model": LlamaForCausalLM,
    "BertModel": BertModel,
    "RobertaModel": BertModel,
    "XLMRobertaModel": BertModel,
    "BertForSequenceClassification": BertModel,
    "RobertaForSequenceClassification": BertModel,
    "XLMRobertaForSequenceClassification": BertModel,
    "LlamaForSequenceClassification": LlamaForCausalLM,
    "MistralForSequenceClassification": LlamaForCausalLM,
    "Qwen2ForSequenceClassification": LlamaForCausalLM,
    "Qwen3ForSequenceClassification": LlamaForCausalLM,
}
_REGISTRY.update(_POOLING)


def is_pooling_only(architecture: str) -> bool:
    """Whether the architecture has no LM head to generate with (it can only pool)."""
    return architecture in _POOLING


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class(architecture: str):
    if architecture not in _REGISTRY:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}")
    return _REGISTRY[architecture]
