"""Random LoRA adapters in PEFT's on-disk format, for benchmarks: adapter_config.json and
adapter_model.safetensors (written by safetensors) with A and B factors on every attention and MLP projection
of every layer, sized from the model's config.json."""

from __future__ import annotations

import json
import os

import numpy as np

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of a Llama-family layer."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def write_random_adapters(model_dir: str, count: int, rank: int = 16, seed: int = 0) -> list[str]:
    """`count` adapters of rank `rank` over the model in `model_dir`, under the cache root (reused when already
    written); their paths."""
    import hashlib

    from safetensors.numpy import save_file

    from paged.kernels.cache import cache_root
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    model_key = hashlib.sha256(os.path.abspath(model_dir).encode()).hexdigest()[:12]
    out_dir = str(cache_root() / "benchmarks" / "lora" / model_key)
    shapes = projection_shapes(config)
    paths = []
    for index in range(count):
        path = os.path.join(out_dir, f"adapter-r{rank}-{index}")
        paths.append(path)
        if os.path.exists(os.path.join(path, "adapter_model.safetensors")):
            continue
        rng = np.random.default_rng(seed + index)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for target in TARGETS:
                module = ("self_attn" if target[0] in "qkvo" else "mlp") + "." + target
                prefix = f"base_model.model.model.layers.{layer}.{module}"
                in_features, out_features = shapes[target]
                tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, in_features ** -0.5, (rank, in_features)
                                                                ).astype(np.float32)
                tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.02, (out_features, rank)).astype(np.float32)
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                       "target_modules": list(TARGETS), "bias": "none", "base_model_name_or_path": model_dir}, f)
    return paths
