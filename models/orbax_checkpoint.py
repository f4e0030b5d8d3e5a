"""paged's Orbax checkpoints: a loaded model's weights as the engine holds them, restored straight onto a mesh.

A directory written by `LLM.save(path)` or `paged convert MODEL OUT`:
    config.json, tokenizer and chat-template files   the source checkpoint's own (so `LLM(path)` reads it alike)
    paged_checkpoint.json                            how the weights were laid out when saved (SavedLayout)
    params/                                          the parameter tree, an Orbax (OCDBT) PyTree checkpoint

The tree is the one the model runs on, as it is held: quantized codes and scales in their packed layout, the
vocabulary padded and KV heads repeated for the tensor-parallel size it was saved at, layers stacked
([layers, ...], the scanned loop) or a list of layers (the unrolled loop, CPU's default). Restoring reads the
tree with each array's target sharding, so every process reads only the shards its devices hold (Orbax
resharding: the saved sharding does not have to match); a checkpoint from the other layer loop is converted
once, on the devices.
A layout that differs from what the restoring engine builds (another dtype, quantization, or a tensor-parallel
size that pads or repeats differently) is refused with the difference named.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

LAYOUT_FILE = "paged_checkpoint.json"
PARAMS_DIR = "params"
FORMAT = "paged-orbax"
VERSION = 1
# Files of a Hugging Face checkpoint that are weights (not copied: the Orbax tree replaces them).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json", ".bin.index.json")


@dataclasses.dataclass(frozen=True)
class SavedLayout:
    """What decides the saved tree's shapes and dtypes, beyond config.json."""

    dtype: str  # the float dtype the weights were held in
    weight_quant: dict | None  # models.quantization.WeightQuant's fields; None: not quantized
    padded_vocab_size: int | None
    kv_head_replicas: int
    kv_scales: bool  # per-layer fp8 KV scales are in the tree
    tensor_parallel_size: int  # for messages: the size it was saved at

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> SavedLayout:
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(f"{LAYOUT_FILE}: expected format {FORMAT!r} version {VERSION}, got "
                             f"{data.get('format')!r} version {data.get('version')!r}")
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


def is_orbax_checkpoint(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, LAYOUT_FILE))


def read_layout(model_dir: str) -> SavedLayout:
    with open(os.path.join(model_dir, LAYOUT_FILE)) as f:
        return SavedLayout.from_json(json.load(f))


def save_checkpoint(path: str, params: dict, source_dir: str, layout: SavedLayout, tokenizer=None) -> None:
    """Writes `params` (the engine's tree, without its precomputed tables) and the source checkpoint's config
    and tokenizer files to a new directory `path`. Every process of a multi-host run must call it (Orbax
    writes each process's shards)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    if os.path.exists(path) and os.listdir(path):
        raise FileExistsError(f"{path} exists and is not empty: save to a new directory")
    os.makedirs(path, exist_ok=True)
    for name in sorted(os.listdir(source_dir)):
        source = os.path.join(source_dir, name)
        if os.path.isfile(source) and not name.endswith(_WEIGHT_SUFFIXES) and name != LAYOUT_FILE:
            shutil.copy2(source, os.path.join(path, name))
    if tokenizer is not None:  # a tokenizer given apart from the model (`tokenizer=`) travels with it
        tokenizer.save_pretrained(path)
    # Uncompressed: weights shrink little under zstd (random bfloat16 ones to 78%), and decompressing made a
    # 0.5B model's start-up 15% slower (`paged bench startup`).
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    checkpointer.save(os.path.join(path, PARAMS_DIR), args=ocp.args.PyTreeSave(params))
    if jax.process_index() == 0:
        with open(os.path.join(path, LAYOUT_FILE), "w") as f:
            json.dump(layout.to_json(), f, indent=2)


def restore_params(model_dir: str, expected: dict, shardings: dict, layout: SavedLayout, wanted: SavedLayout,
                   stacked_layers: bool) -> dict:
    """The saved tree, each array placed with `shardings[key]` (keys as models.loader.parameter_shapes', layers
    stacked), in the layer layout asked for (`stacked_layers`, else a list of layers).

    `expected`: key -> (shape, dtype) the restoring model needs; `wanted`: the layout it would build. A
    difference is a ValueError naming it before anything is read."""
    import orbax.checkpoint as ocp

    _check_layout(layout, wanted)
    directory = os.path.join(os.path.abspath(model_dir), PARAMS_DIR)
    checkpointer = ocp.StandardCheckpointer()
    saved_tree = checkpointer.metadata(directory).item_metadata.tree
    saved_as_list = isinstance(saved_tree.get("layers"), list)
    if saved_as_list:  # saved from the unrolled loop: the same arrays, one per layer
        expected, shardings = _per_layer(expected, shardings, len(saved_tree["layers"]))
    saved = {key: (tuple(meta.shape), np.dtype(meta.dtype)) for key, meta in _flat(saved_tree).items()}
    missing = sorted(".".join(k) for k in expected if k not in saved)
    extra = sorted(".".join(k) for k in saved if k not in expected)
    if missing or extra:
        raise ValueError(f"{model_dir}: the saved tree does not fit this model (missing: {missing[:5]}, "
                         f"unexpected: {extra[:5]})")
    for key, (shape, dtype) in expected.items():
        if saved[key] != (shape, dtype):
            raise ValueError(f"{model_dir}: {'.'.join(key)} was saved as {saved[key][1]}{list(saved[key][0])}; this "
                             f"engine needs {dtype}{list(shape)} (it was saved at tensor_parallel_size="
                             f"{layout.tensor_parallel_size})")
    target: dict = {}
    for key, (shape, dtype) in expected.items():
        _put(target, key, jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[key]))
    if saved_as_list:
        target["layers"] = [target["layers"][str(i)] for i in range(len(target["layers"]))]
    params = checkpointer.restore(directory, target)
    if saved_as_list == stacked_layers:  # the other loop's layout: converted once, on the devices
        return stacked(params) if stacked_layers else unstacked(params)
    return params


def _per_layer(expected: dict, shardings: dict, num_layers: int) -> tuple[dict, dict]:
    """Stacked [layers, ...] entries as one entry per layer (key `layers/<i>/...`, the layer axis dropped)."""
    per_layer_expected, per_layer_shardings = {}, {}
    for key, (shape, dtype) in expected.items():
        if key[0] != "layers":
            per_layer_expected[key], per_layer_shardings[key] = (shape, dtype), shardings[key]
            continue
        sharding = shardings[key]
        if isinstance(sharding, jax.sharding.NamedSharding):
            sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
        for i in range(num_layers):
            layer_key = ("layers", str(i), *key[1:])
            per_layer_expected[layer_key], per_layer_shardings[layer_key] = (shape[1:], dtype), sharding
    return per_layer_expected, per_layer_shardings


def _check_layout(saved: SavedLayout, wanted: SavedLayout) -> None:
    for field, why in (("dtype", "pass dtype to match, or load the original checkpoint"),
                       ("weight_quant", "quantization is fixed when the checkpoint is saved"),
                       ("padded_vocab_size", "the vocabulary is padded to a multiple of the tensor-parallel size"),
                       ("kv_head_replicas", "KV heads are repeated when the tensor-parallel size exceeds them")):
        got, want = getattr(saved, field), getattr(wanted, field)
        if got != want:
            raise ValueError(f"this checkpoint was saved with {field}={got!r} (tensor_parallel_size="
                             f"{saved.tensor_parallel_size}); this engine builds {field}={want!r}: {why}. Restore "
                             "it at a setting with the same layout, or load the original Hugging Face checkpoint")


def stacked(params: dict) -> dict:
    """The tree with layers stacked ([layers, ...] per parameter), whichever loop it was built for."""
    layers = params.get("layers")
    if not isinstance(layers, list):
        return params
    return {**params, "layers": jax.tree.map(lambda *leaves: jnp.stack(leaves), *layers)}


def unstacked(params: dict) -> dict:
    """The tree with `layers` as a list of per-layer trees (the unrolled loop's layout)."""
    layers = params["layers"]
    count = jax.tree.leaves(layers)[0].shape[0]
    return {**params, "layers": [jax.tree.map(lambda leaf, i=i: leaf[i], layers) for i in range(count)]}


def _flat(tree) -> dict[tuple[str, ...], object]:
    return {tuple(str(getattr(p, "key", getattr(p, "idx", p))) for p in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _put(tree: dict, key: tuple[str, ...], value) -> None:
    for part in key[:-1]:
        tree = tree.setdefault(part, {})
    tree[key[-1]] = value
