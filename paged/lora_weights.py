"""The device side of LoRA: a PEFT adapter's factors matched to the model's slots, and written into one.

Every adapted projection holds `lora_a` [in, slots, rank] and `lora_b` [slots, rank, out] (paged.models.linear),
stacked over layers ([layers, slots, ...]) or one per layer, as the model's other weights are. An adapter's
factors are checked against those shapes when it is read (an adapter made for another model is refused then,
not at its first step), and a slot is written by replacing each factor's slice: the arrays keep their shapes
and shardings, so nothing recompiles.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from paged.lora import LoRAAdapter
from paged.models.linear import LORA_FACTORS
from paged.models.loader import repeat_kv_heads

# (tree key of the projection without its factor name, e.g. ("layers", "self_attn", "q_proj"), layer)
ModuleKey = tuple[tuple[str, ...], int]


class _FactorsAsWeights:
    """B^T of each fused module posing as its checkpoint weight, so the model's own `split_fused` cuts it as it
    cuts the weight (Phi-3's qkv_proj into q/k/v, gate_up_proj into gate/up; LoRA's A is shared by the parts)."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors = tensors

    def get_tensor(self, name: str) -> np.ndarray:
        return self.tensors[name]


def match_adapter(adapter: LoRAAdapter, model, expected: dict) -> dict[ModuleKey, tuple[np.ndarray, np.ndarray]]:
    """The adapter's factors by the model's projection and layer; raises ValueError naming a module the model
    does not adapt or whose shapes differ from the model's (an adapter trained for another architecture).

    `expected`: the model's parameter shapes (paged.models.loader.parameter_shapes), LoRA factors among them."""
    cfg = model.config
    matched: dict[ModuleKey, tuple[np.ndarray, np.ndarray]] = {}
    for module, (a, b) in adapter.modules.items():
        weight = f"{module}.weight"
        parts = list(model.split_fused(weight, _FactorsAsWeights({weight: b.T})))
        for name, read in parts:
            target = model.checkpoint_target(name)
            key = target[0][:-1] if target is not None else None
            if key is None or key + ("lora_a",) not in expected or not isinstance(target[1], int):
                raise ValueError(f"LoRA adapter {adapter.name!r}: {module} is not a projection LoRA applies to here "
                                 "(q/k/v/o_proj and gate/up/down_proj of the decoder layers)")
            part_b = np.ascontiguousarray(read().T)  # [r, out]
            if cfg.kv_head_replicas > 1 and key[-2:] in (("self_attn", "k_proj"), ("self_attn", "v_proj")):
                part_b = repeat_kv_heads(part_b, cfg.kv_head_replicas, cfg.head_dim)
            (_, in_features, _, _), (_, _, _, out_features) = (expected[key + ("lora_a",)][0],
                                                              expected[key + ("lora_b",)][0])
            if a.shape[0] != in_features or part_b.shape[1] != out_features:
                raise ValueError(f"LoRA adapter {adapter.name!r}: {name[:-len('.weight')]} maps {a.shape[0]} -> "
                                 f"{part_b.shape[1]} features, the model's {in_features} -> {out_features}: the "
                                 f"adapter was made for another model ({cfg.architecture} here)")
            matched[(key, target[1])] = (a, part_b)
    return matched


def lora_keys(expected: dict) -> list[tuple[str, ...]]:
    """The keys of the model's adapted projections (without the factor name)."""
    return sorted({key[:-1] for key in expected if key[-1] == "lora_a"})


def write_slot(params: dict, expected: dict, slot: int, factors: dict[ModuleKey, tuple[np.ndarray, np.ndarray]]
               ) -> None:
    """Writes an adapter's factors (`match_adapter`'s) into `slot` of every adapted projection in `params` (in
    place in the dict; the arrays are replaced). Projections the adapter leaves alone get zeros."""
    for key in lora_keys(expected):
        (layers, in_features, _, rank), (_, _, _, out_features) = (expected[key + ("lora_a",)][0],
                                                                  expected[key + ("lora_b",)][0])
        a = np.zeros((layers, in_features, rank), np.float32)
        b = np.zeros((layers, rank, out_features), np.float32)
        for layer in range(layers):
            if (key, layer) in factors:
                layer_a, layer_b = factors[(key, layer)]
                a[layer, :, :layer_a.shape[1]], b[layer, :layer_b.shape[0]] = layer_a, layer_b
        for name, value in zip(LORA_FACTORS, (a, b)):
            slot_axis = 1 if name == "lora_a" else 0  # of one layer's factor: A [in, slots, rank], B [slots, ...]
            if isinstance(params["layers"], list):
                for layer, tree in enumerate(params["layers"]):
                    leaf_tree = _subtree(tree, key[1:])
                    leaf = leaf_tree[name]
                    write = _slot_writer(placement_of(leaf), slot_axis)
                    leaf_tree[name] = write(leaf, value[layer].astype(leaf.dtype), np.int32(slot))
            else:
                leaf_tree = _subtree(params, key)
                leaf = leaf_tree[name]
                write = _slot_writer(placement_of(leaf), slot_axis + 1)
                leaf_tree[name] = write(leaf, value.astype(leaf.dtype), np.int32(slot))


def _subtree(tree: dict, path: tuple[str, ...]) -> dict:
    for part in path:
        tree = tree[part]
    return tree


def placement_of(leaf: jax.Array):
    """The sharding a rewritten factor must keep: its own where it was placed explicitly; None for an array on
    the default device that was never committed to it (as the loader leaves the other weights there: a step
    whose arguments mix committed and uncommitted arrays leaves jit's fast dispatch path, which cost a 30M
    model's steps 3 ms each)."""
    return leaf.sharding if getattr(leaf, "_committed", True) else None


@functools.lru_cache(maxsize=None)
def _slot_writer(sharding, axis: int):
    """(factor, value, slot) -> factor with its slot (index `slot` of axis `axis`) replaced by value, kept in
    `sharding` (None: left uncommitted); the slot is traced, so one compile serves every slot."""
    def write(leaf, value, slot):
        index = (slice(None),) * axis + (slot,)
        return leaf.at[index].set(value)
    return jax.jit(write) if sharding is None else jax.jit(write, out_shardings=sharding)


def without_lora(tree):
    """`tree` without its LoRA factors (what a checkpoint holds)."""
    if isinstance(tree, dict):
        return {k: without_lora(v) for k, v in tree.items() if k not in LORA_FACTORS}
    if isinstance(tree, list):
        return [without_lora(v) for v in tree]
    return tree


def with_lora_of(tree, source):
    """`tree` (without LoRA factors) with the LoRA factors of `source` (the same model's tree) put back."""
    if isinstance(tree, dict):
        out = {k: with_lora_of(v, source[k]) for k, v in tree.items()}
        out.update({k: v for k, v in source.items() if k in LORA_FACTORS})
        return out
    if isinstance(tree, list):
        return [with_lora_of(v, s) for v, s in zip(tree, source)]
    return tree
