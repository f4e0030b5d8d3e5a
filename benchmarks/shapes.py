"""Random-weight checkpoints shaped like real models, built on the fly: `--model-shape NAME`.

A benchmark at a toy size says little about the sizes people serve: at 0.5B parameters and a 152k vocabulary
the weights no longer fit the caches, a decode step streams a gigabyte, and the LM head is a tenth of the
model. These checkpoints have a real model's config (HF format, the family's own architecture name, so every
engine reads them) with random weights in bfloat16, as the Hub ships them, and the tiny model's trained
tokenizer (ids past its vocabulary have no text; benchmarks feed token ids).
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

# config.json fields of each shape (Qwen2.5-0.5B: its published config, minus the weights).
MODEL_SHAPES = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1,
        "sliding_window": None, "use_sliding_window": False, "torch_dtype": "bfloat16",
    },
    # Qwen3-0.6B: 16 query and 8 KV heads (tensor parallel 2, 4 and 8 divide them), q/k norms, no biases.
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "attention_bias": False, "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 0,
        "eos_token_id": 1, "sliding_window": None, "use_sliding_window": False, "torch_dtype": "bfloat16",
    },
    # Llama-3.1-8B: its published config. 16 GB in bfloat16: time it with load_format="dummy", which draws the
    # weights on the devices from `model_shape_config_dir`'s config alone.
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    },
}

# Random weights at the scale of trained ones (std 0.02, HF's initializer_range): activations stay in
# bfloat16's comfortable range over 24 layers.
_WEIGHT_STD = 0.02


def _tensors(config: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim", hidden // config["num_attention_heads"])
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    biases = config.get("attention_bias", config["model_type"] == "qwen2")  # Qwen2's q/k/v have biases

    def normal(*shape):
        return (rng.standard_normal(shape, np.float32) * _WEIGHT_STD).astype(ml_dtypes.bfloat16)

    ones = lambda n: np.ones(n, ml_dtypes.bfloat16)
    tensors = {"model.embed_tokens.weight": normal(vocab, hidden), "model.norm.weight": ones(hidden)}
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = normal(vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": ones(hidden), p + "post_attention_layernorm.weight": ones(hidden),
            p + "self_attn.q_proj.weight": normal(q, hidden), p + "self_attn.k_proj.weight": normal(kv, hidden),
            p + "self_attn.v_proj.weight": normal(kv, hidden), p + "self_attn.o_proj.weight": normal(hidden, q),
            p + "mlp.gate_proj.weight": normal(inter, hidden), p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
        })
        if biases:
            tensors.update({p + "self_attn.q_proj.bias": normal(q), p + "self_attn.k_proj.bias": normal(kv),
                            p + "self_attn.v_proj.bias": normal(kv)})
        if config["model_type"] == "qwen3":  # per-head RMSNorm of q and k
            tensors.update({p + "self_attn.q_norm.weight": ones(head_dim), p + "self_attn.k_norm.weight": ones(head_dim)})
    return tensors


def _shape_directory(name: str, folder: str, last_file: str) -> tuple[str, bool]:
    """(shape `name`'s directory `folder` under the cache root, whether it is whole: `last_file`, written last,
    is there). One that is not is made, with the tokenizer in it."""
    from paged.kernels.cache import cache_root
    from paged.models.tiny import _train_tokenizer
    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose one of {sorted(MODEL_SHAPES)}")
    directory = str(cache_root() / "benchmarks" / folder)
    if os.path.exists(os.path.join(directory, last_file)):
        return directory, True
    os.makedirs(directory, exist_ok=True)
    _train_tokenizer(directory, 512)
    return directory, False


def model_shape_config_dir(name: str) -> str:
    """A directory with shape `name`'s config.json and the tokenizer, no weights: for load_format="dummy"."""
    directory, whole = _shape_directory(name, f"{name}-config", "config.json")
    if not whole:
        config = os.path.join(directory, "config.json")
        with open(config + ".partial", "w") as f:
            json.dump(MODEL_SHAPES[name], f, indent=2)
        os.replace(config + ".partial", config)  # last: a directory with a config is whole
    return directory


def model_shape_dir(name: str, seed: int = 0) -> str:
    """The checkpoint directory for shape `name` under the cache root, written on first use (~1 GB for 0.5B)."""
    from paged.models.builtin import RANDOM_WEIGHTS_KEY
    directory, whole = _shape_directory(name, f"{name}-random-seed{seed}", "model.safetensors")
    if whole:
        return directory
    weights = os.path.join(directory, "model.safetensors")
    config = MODEL_SHAPES[name]
    tensors = _tensors(config, np.random.default_rng(seed))
    save_file(tensors, weights + ".partial", metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**config, RANDOM_WEIGHTS_KEY: True}, f, indent=2)
    os.replace(weights + ".partial", weights)  # last: a crash mid-write never leaves a checkpoint that looks whole
    return directory
