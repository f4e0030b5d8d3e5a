"""Flax model definitions and Hugging Face checkpoint loading."""

from paged.models.attention import AttentionMetadata, get_attention_backend
from paged.models.config import ModelConfig, RopeConfig, load_model_config, model_config_from_hf
from paged.models.loader import load_model, resolve_dtype, resolve_model_path
from paged.models.registry import model_class, supported_architectures

__all__ = [
    "AttentionMetadata", "ModelConfig", "RopeConfig", "get_attention_backend", "load_model",
    "load_model_config", "model_class", "model_config_from_hf", "resolve_dtype", "resolve_model_path",
    "supported_architectures",
]
