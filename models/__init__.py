"""Flax model definitions and Hugging Face checkpoint loading."""

from models.attention import AttentionMetadata, get_attention_backend
from models.config import ModelConfig, RopeConfig, load_model_config, model_config_from_hf
from models.loader import load_model, resolve_dtype, resolve_model_path
from models.registry import model_class, supported_architectures

__all__ = [
    "AttentionMetadata", "ModelConfig", "RopeConfig", "get_attention_backend", "load_model",
    "load_model_config", "model_class", "model_config_from_hf", "resolve_dtype", "resolve_model_path",
    "supported_architectures",
]
