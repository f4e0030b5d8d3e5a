"""Loads Hugging Face checkpoints (config.json + safetensors) into our parameter trees.

Weights stream tensor by tensor from memory-mapped safetensors into preallocated, layer-stacked host
buffers of the target dtype; each finished buffer goes to the device and is dropped on the host, so at most
one full copy of the weights exists at a time (plus one tensor).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from safetensors import safe_open
from tqdm.auto import tqdm

from models.config import ModelConfig, load_model_config
from models.quantized_checkpoints import convert, is_online, quantize_online, quantized_suffixes, weight_quant
from models.registry import model_class

_DTYPES = {
    "float32": np.float32, "float": np.float32, "fp32": np.float32,
    "bfloat16": ml_dtypes.bfloat16, "bf16": ml_dtypes.bfloat16,
    "float16": np.float16, "half": np.float16, "fp16": np.float16,
}

_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def resolve_dtype(dtype: Any, config: ModelConfig) -> np.dtype:
    """vLLM spellings ("auto", "half", "float", "bfloat16", ...) or a numpy/jax dtype -> numpy dtype.

    "auto" keeps the checkpoint's dtype (a float32 checkpoint runs in float32, which CPU needs anyway).
    """
    if isinstance(dtype, str):
        key = dtype.lower()
        if key == "auto":
            key = config.checkpoint_dtype
            if key not in _DTYPES:
                key = "float32"
        if key not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; use one of 'auto', {sorted(_DTYPES)}")
        return np.dtype(_DTYPES[key])
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"unsupported dtype {dtype!r}") from None
    if resolved not in {np.dtype(t) for t in _DTYPES.values()}:
        raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")
    return resolved


def resolve_model_path(model: str) -> str:
    """A local directory, else a hub id downloaded (config, tokenizer, safetensors only)."""
    if os.path.isdir(model):
        if not os.path.exists(os.path.join(model, "config.json")):
            raise ValueError(f"model directory {model!r} has no config.json")
        return model
    if os.path.exists(model):
        raise ValueError(f"model path {model!r} is a file; pass the checkpoint directory")
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ValueError(f"model path {model!r} does not exist")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, allow_patterns=_HUB_PATTERNS)
    except Exception as exc:  # noqa: BLE001 - any hub failure becomes one clear message
        raise ValueError(f"model {model!r} is not a local directory and could not be fetched from the "
                         f"Hugging Face hub: {type(exc).__name__}: {exc}") from exc


def _safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {model_dir!r} (PyTorch .bin checkpoints are not supported)")
    return [os.path.join(model_dir, f) for f in files]


def _flat(tree) -> dict[tuple[str, ...], Any]:
    return {tuple(p.key for p in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _expected(model) -> dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of every parameter the model needs: its global ones and its decoder layer's, stacked over
    layers (from the modules' own init)."""
    out = {key: (leaf.shape, np.dtype(leaf.dtype)) for key, leaf in _flat(nn.unbox(model.global_params())).items()}
    for key, leaf in _flat(nn.unbox(model.layer_params())).items():
        out[("layers", *key)] = ((model.config.num_layers, *leaf.shape), np.dtype(leaf.dtype))
    return out


def partition_specs(model) -> dict[tuple[str, ...], PartitionSpec]:
    """Each parameter's `PartitionSpec` over mesh axes (models.linear), keyed as `_expected` is: the
    stacked layers' leading layer axis is not split."""
    specs = {key: spec for key, spec in _flat(nn.get_partition_spec(model.global_params())).items()}
    for key, spec in _flat(nn.get_partition_spec(model.layer_params())).items():
        specs[("layers", *key)] = PartitionSpec(None, *spec)
    return specs


def load_params(model_dir: str, model, config: ModelConfig, dtype: np.dtype, show_progress: bool = True,
                stacked_layers: bool = True, mesh=None, kv_head_replicas: int = 1):
    """Reads every tensor the model needs; returns the parameter tree on the default device.

    With `stacked_layers=False`, `params["layers"]` is a list of per-layer trees instead of one tree stacked
    over layers (for the unrolled layer loop; see models/layers.py `run_layers`). Each layer's arrays are
    copied to the device from views of the host buffer, so neither layout needs the weights twice.

    With a `mesh`, each array is split by its partition spec (`partition_specs`) as it goes to the devices:
    every device receives only its own slice. `kv_head_replicas` > 1 repeats each KV head of k_proj and v_proj
    that many times (the config already counts the copies).
    """
    expected_with_dtypes = _expected(model)
    expected = {key: shape for key, (shape, _) in expected_with_dtypes.items()}
    specs = partition_specs(model) if mesh is not None else {}
    buffers: dict[tuple[str, ...], np.ndarray] = {}
    filled: dict[tuple[str, ...], int] = {}
    params: dict = {}
    files = _safetensors_files(model_dir)
    scheme = config.weight_quant
    quantized_layers: dict[str, dict[str, np.ndarray]] = {}  # checkpoint prefix -> its packed tensors

    def offer(name: str, read) -> None:
        target = model.checkpoint_target(name)
        if target is None or target[0] not in expected:
            return  # e.g. rotary inv_freq buffers, or lm_head when tied
        key, index, transpose = target
        index = () if index is None else (index,) if isinstance(index, int) else tuple(index)
        tensor = read().T if transpose else read()
        if kv_head_replicas > 1 and key[-3:-1] in (("self_attn", "k_proj"), ("self_attn", "v_proj")):
            tensor = _repeat_kv_heads(tensor, kv_head_replicas, config.head_dim)
        want = expected[key][len(index):]
        if tensor.shape != want:
            raise ValueError(f"checkpoint tensor {name} has shape {tensor.shape} (after transpose: "
                             f"{transpose}); the config implies {want}")
        if key not in buffers:
            buffers[key] = np.empty(expected[key], expected_with_dtypes[key][1])
            filled[key] = 0
        buffers[key][index] = tensor
        filled[key] += 1
        if filled[key] == int(np.prod(expected[key][:len(index)])):  # every layer (and expert)
            _put_loaded(params, key, buffers.pop(key), stacked_layers, config.num_layers, mesh, specs.get(key))
        bar.update()

    def quantized_key(prefix: str) -> tuple[str, ...] | None:
        target = model.checkpoint_target(prefix + ".paged_qweight")
        return target[0] if target is not None and target[0] in expected else None

    with tqdm(desc="Loading weights", unit="tensor", disable=not show_progress) as bar:
        for path in files:
            with safe_open(path, framework="np") as opened:
                f = _WithFloat8(opened, path)
                for stored_name in f.keys():
                    for name, read in model.split_fused(stored_name, f):
                        prefix, _, suffix = name.rpartition(".")
                        if scheme is not None and quantized_key(prefix) is not None:
                            if is_online(scheme) and suffix == "weight":
                                for part, array in quantize_online(read().T, scheme, dtype).items():
                                    offer(f"{prefix}.paged_{part}", lambda array=array: array)
                                continue
                            if suffix in quantized_suffixes(scheme):  # converted once the layer's are all read
                                quantized_layers.setdefault(prefix, {})[suffix] = read()
                                continue
                        offer(name, read)
        for prefix, tensors in quantized_layers.items():
            key = quantized_key(prefix)
            packed_rows, out_features = expected[key][-2:]  # [layers, (experts,) rows, out]
            in_features = packed_rows * (2 if scheme.bits == 4 else 1)  # int4: two rows a byte
            for part, array in convert(prefix, tensors, scheme, in_features, out_features, dtype).items():
                offer(f"{prefix}.paged_{part}", lambda array=array: array)
    missing = [".".join(k) for k in expected if _get(params, k) is None and _get_layer0(params, k) is None]
    if missing:
        raise ValueError(f"checkpoint in {model_dir!r} lacks tensors for: {', '.join(missing)}")
    return params


def _put_loaded(params: dict, key: tuple[str, ...], buffer: np.ndarray, stacked_layers: bool,
                num_layers: int, mesh=None, spec: PartitionSpec | None = None) -> None:
    def to_device(array, spec):
        if mesh is None:
            return jax.device_put(array)
        return jax.device_put(array, NamedSharding(mesh, _divisible(spec, array.shape, mesh)))

    if key[0] != "layers" or stacked_layers:
        _put(params, key, to_device(buffer, spec))
        return
    layers = params.setdefault("layers", [{} for _ in range(num_layers)])
    layer_spec = PartitionSpec(*spec[1:]) if spec is not None else None  # without the stacked layer axis
    for layer, tree in enumerate(layers):
        _put(tree, key[1:], to_device(buffer[layer], layer_spec))


def _divisible(spec: PartitionSpec | None, shape: tuple[int, ...], mesh) -> PartitionSpec:
    """`spec`, with every split the mesh cannot make evenly dropped (that dimension replicated): e.g. a
    vocabulary of 470 rows over 4 devices. Padding such tables instead would save the memory; not done yet."""
    if spec is None:
        return PartitionSpec()
    kept = [axis if axis is None or shape[dim] % mesh.shape[axis] == 0 else None for dim, axis in enumerate(spec)]
    return PartitionSpec(*kept)


def _put(tree: dict, key: tuple[str, ...], value) -> None:
    for part in key[:-1]:
        tree = tree.setdefault(part, {})
    tree[key[-1]] = value


def _get(tree: dict, key: tuple[str, ...]):
    for part in key:
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _get_layer0(tree: dict, key: tuple[str, ...]):
    layers = tree.get("layers")
    if key[0] != "layers" or not isinstance(layers, list):
        return None
    return _get(layers[0], key[1:])


def load_model(model: str, dtype: Any = "auto", show_progress: bool = True, stacked_layers: bool = True,
               linear_backend: str = "xla", mesh=None, quantization: str | None = None):
    """Returns (model_dir, config, model, params, numpy dtype); see load_params for `stacked_layers` and
    `mesh`, models.linear for `linear_backend`, models/quantized_checkpoints.py for `quantization` (None: the
    checkpoint's own `quantization_config`, if any)."""
    model_dir = resolve_model_path(model)
    config = load_model_config(model_dir)
    cls = model_class(config.architecture)
    scheme = weight_quant(_quantization_config(model_dir), quantization)
    if scheme is not None:
        if cls.__name__ != "LlamaForCausalLM":
            raise NotImplementedError(f"quantized {config.architecture} models are not implemented yet")
        if mesh is not None:
            raise NotImplementedError("quantized models with tensor parallelism are not implemented yet")
        config = dataclasses.replace(config, weight_quant=scheme)
    replicas = kv_head_replicas(config, mesh)
    if replicas > 1:  # the model is built with every KV head repeated; the loader repeats k/v_proj to match
        config = dataclasses.replace(config, num_kv_heads=config.num_kv_heads * replicas)
    np_dtype = resolve_dtype(dtype, config)
    instance = cls(config, np_dtype, linear_backend=linear_backend)
    params = load_params(model_dir, instance, config, np_dtype, show_progress, stacked_layers, mesh, replicas)
    return model_dir, config, instance, params, np_dtype


def kv_head_replicas(config: ModelConfig, mesh) -> int:
    """How many devices share each KV head: mesh size / KV heads when there are fewer KV heads than devices."""
    if mesh is None:
        return 1
    size = int(np.prod(list(mesh.shape.values())))
    return size // config.num_kv_heads if config.num_kv_heads < size else 1


def _repeat_kv_heads(tensor: np.ndarray, replicas: int, head_dim: int) -> np.ndarray:
    """k/v_proj kernel [in, Hkv * D] or bias [Hkv * D] with each head's D columns repeated `replicas` times in
    place ([h0, h0, h1, h1, ...]): query head h of a group then meets the copy of its own KV head on its device."""
    heads = tensor.reshape(*tensor.shape[:-1], -1, head_dim)
    return np.repeat(heads, replicas, axis=-2).reshape(*tensor.shape[:-1], -1)


class _WithFloat8:
    """A safetensors handle that also reads float8 tensors (F8_E4M3, F8_E5M2), which safetensors' numpy
    backend cannot name: their bytes are mapped from the file and viewed as ml_dtypes' float8 types."""

    _FLOAT8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}

    def __init__(self, handle, path: str):
        self._handle, self._path = handle, path
        self._header: dict | None = None

    def keys(self):
        return self._handle.keys()

    def get_tensor(self, name: str) -> np.ndarray:
        header = self._read_header()
        entry = header.get(name, {})
        if entry.get("dtype") not in self._FLOAT8:
            return self._handle.get_tensor(name)
        start, end = entry["data_offsets"]
        raw = np.memmap(self._path, np.uint8, "r", offset=self._data_start + start, shape=(end - start,))
        return np.array(raw).view(self._FLOAT8[entry["dtype"]]).reshape(entry["shape"])

    def _read_header(self) -> dict:
        if self._header is None:
            with open(self._path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self._header = json.loads(f.read(size))
            self._data_start = 8 + size
        return self._header


def _quantization_config(model_dir: str) -> dict | None:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f).get("quantization_config")


def weight_bytes(params) -> dict[str, int]:
    """Bytes of the parameters by dtype ("int8", "uint8" (packed int4), "bfloat16", ...) and their "total"."""
    out: dict[str, int] = {}
    for leaf in jax.tree_util.tree_leaves(params):
        name = np.dtype(leaf.dtype).name
        out[name] = out.get(name, 0) + int(leaf.nbytes)
    out["total"] = sum(out.values())
    return out
