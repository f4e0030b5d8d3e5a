"""LoRA adapters: vLLM's `LoRARequest` and `LoRAConfig`, and PEFT adapters read into per-module factors.

A PEFT adapter is a directory with `adapter_config.json` and `adapter_model.safetensors`. Its tensors are named
`base_model.model.<module path>.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]). The layer adds
`scaling * x @ A^T @ B^T` to the base layer's output, where `scaling` is `lora_alpha / r` (`lora_alpha / sqrt(r)`
with rsLoRA). `rank_pattern` and `alpha_pattern` override r and alpha for the modules whose names end with
their keys. What the engine cannot apply is refused by name: DoRA, `modules_to_save`, adapter biases, and
embedding adapters.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

# The ranks vLLM accepts for max_lora_rank.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_PREFIX = "base_model.model."
_FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?P<factor>[AB])(?:\.[^.]+)?\.weight$")


@dataclasses.dataclass(frozen=True, eq=False)
class LoRARequest:
    """An adapter a request runs with, as vLLM spells it: `LoRARequest("sql", 1, "/path/to/adapter")`.

    Two requests are the same adapter when their names are (vLLM compares and hashes by name)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path cannot be empty")

    def __eq__(self, other) -> bool:
        return isinstance(other, LoRARequest) and other.lora_name == self.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """How many adapters the engine holds: `max_loras` on the device at once (each a slot of every adapted
    layer's stacked factors), `max_cpu_loras` in host memory (least recently used first out; default
    `max_loras`), each of rank at most `max_lora_rank`."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self):
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be an integer >= 1, got {self.max_loras!r}")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {LORA_RANKS}, got {self.max_lora_rank!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """A PEFT adapter read from disk: module path (as in the HF checkpoint, e.g. `model.layers.0.self_attn.q_proj`)
    -> (a [in, r] float32, b [r, out] float32 with the scaling folded in), so the layer adds `x @ a @ b`."""

    name: str
    path: str
    rank: int  # the largest of its modules' ranks
    modules: dict[str, tuple[np.ndarray, np.ndarray]]


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rule for rank_pattern / alpha_pattern: the first key that `module` ends with at a dot boundary."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_peft_adapter(name: str, path: str, max_lora_rank: int) -> LoRAAdapter:
    """Reads the PEFT LoRA adapter at `path` (a directory); raises ValueError naming what it cannot apply."""
    config_path = os.path.join(path, "adapter_config.json")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(config_path) or not os.path.isfile(weights_path):
        raise ValueError(f"LoRA adapter {name!r}: no adapter found at {path} (expected adapter_config.json and "
                         "adapter_model.safetensors, as PEFT's save_pretrained writes)")
    with open(config_path) as f:
        config = json.load(f)
    missing = [key for key in ("r", "lora_alpha", "target_modules") if key not in config]
    if missing:
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json lacks {', '.join(missing)}")
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {config['peft_type']!r} is not LORA")
    if config.get("use_dora"):
        problems.append("DoRA (use_dora) is not supported")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save {config['modules_to_save']} is not supported (only LoRA factors are)")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        problems.append("adapter biases (bias / lora_bias) are not supported")
    ranks = [config["r"], *config.get("rank_pattern", {}).values()]
    if max(ranks) > max_lora_rank:
        problems.append(f"LoRA rank {max(ranks)} is greater than max_lora_rank {max_lora_rank}")
    if problems:
        raise ValueError(f"LoRA adapter {name!r} ({path}): {'; '.join(problems)}")

    from safetensors.numpy import load_file
    factors: dict[str, dict[str, np.ndarray]] = {}
    for key, tensor in load_file(weights_path).items():
        match = _FACTOR.match(key.removeprefix(_PREFIX))
        if match is None:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA factor of a linear layer "
                             "(embedding adapters and other tensors are not supported)")
        factors.setdefault(match["module"], {})[match["factor"]] = tensor
    modules = {}
    for module, pair in sorted(factors.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {module} has lora_{next(iter(pair))} without its partner")
        a, b = pair["A"].astype(np.float32), pair["B"].astype(np.float32)  # [r, in], [out, r]
        rank = _pattern_value(config.get("rank_pattern", {}), module, config["r"])
        alpha = _pattern_value(config.get("alpha_pattern", {}), module, config["lora_alpha"])
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"LoRA adapter {name!r}: {module}'s factors {a.shape} and {b.shape} are not of rank "
                             f"{rank} (adapter_config.json)")
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules[module] = (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T) * np.float32(scaling))
    if not modules:
        raise ValueError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA factors")
    return LoRAAdapter(name, path, max(a.shape[1] for a, _ in modules.values()), modules)
