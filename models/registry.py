"""Maps Hugging Face `architectures` names to our implementations, and to models registered from outside
(`register_model`; plugins named by PAGED_PLUGINS or installed under the `paged.general_plugins` entry point)."""

from __future__ import annotations

import importlib
import logging
import os

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


logger = logging.getLogger("paged")


def register_model(architecture: str, model, *, pooling: bool = False) -> None:
    """Serves checkpoints whose config.json names `architecture` with `model`: a class meeting paged's model
    contract (models/base.py; `PagedModel` fills in its optional parts), or "module:Class", imported when a
    checkpoint first needs it. `pooling`: the model only pools (it has no LM head). A built-in architecture
    is replaced, with a warning."""
    if not isinstance(architecture, str) or not architecture:
        raise ValueError(f"architecture must be a non-empty string, got {architecture!r}")
    if isinstance(model, str):
        if model.count(":") != 1:
            raise ValueError(f"a lazily registered model is 'module:Class', got {model!r}")
    elif not isinstance(model, type):
        raise ValueError(f"model must be a class or 'module:Class', got {model!r}")
    if architecture in _REGISTRY and _REGISTRY[architecture] is not model:
        logger.warning("register_model: %s was served by %s; now by %s", architecture,
                       getattr(_REGISTRY[architecture], "__name__", _REGISTRY[architecture]),
                       getattr(model, "__name__", model))
    _REGISTRY[architecture] = model
    if pooling:
        _POOLING[architecture] = model
    else:
        _POOLING.pop(architecture, None)


def load_plugins() -> None:
    """Imports the modules that register models: those in PAGED_PLUGINS (comma-separated module names), then
    each installed `paged.general_plugins` entry point (called if it is a function). Each once per process."""
    names = [n.strip() for n in os.environ.get("PAGED_PLUGINS", "").split(",") if n.strip()]
    for name in names:
        if name not in _loaded_plugins:
            importlib.import_module(name)
            _loaded_plugins.add(name)
    from importlib.metadata import entry_points
    for entry in entry_points(group="paged.general_plugins"):
        if entry.name not in _loaded_plugins:
            plugin = entry.load()
            if callable(plugin):
                plugin()
            _loaded_plugins.add(entry.name)


_loaded_plugins: set[str] = set()


def is_pooling_only(architecture: str) -> bool:
    """Whether the architecture has no LM head to generate with (it can only pool)."""
    return architecture in _POOLING


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class(architecture: str):
    if architecture not in _REGISTRY:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())} (or "
            "register your own: paged.register_model)")
    model = _REGISTRY[architecture]
    if isinstance(model, str):  # registered lazily as "module:Class"
        module, _, name = model.partition(":")
        model = getattr(importlib.import_module(module), name)
        _REGISTRY[architecture] = model
        if architecture in _POOLING:
            _POOLING[architecture] = model
    return model
