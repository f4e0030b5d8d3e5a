"""Loads Hugging Face checkpoints (config.json + safetensors) into our parameter trees.

Weights stream tensor by tensor from memory-mapped safetensors straight to the devices: each tensor is
converted to the target dtype on the host, sent (each device receiving only its slice under a mesh) and
dropped, so the host holds about one tensor at a time. Per-layer (and per-expert) tensors are written into
their stacked device buffer as they arrive (`_Placer`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
from safetensors import safe_open
from paged.config import LOAD_FORMATS
from paged.models.progress import progress

from paged.models.config import ModelConfig, load_model_config
from paged.models.dummy_weights import dummy_params
from paged.models.gemma_checkpoint import HFTensors, is_gemma_checkpoint, read_arrays as read_gemma_arrays
from paged.models.linear import LORA_FACTORS, to_declared_layout
from paged.models.orbax_checkpoint import SavedLayout, is_orbax_checkpoint, read_layout, restore_params
from paged.models.quantization import WeightQuant
from paged.models.quantized_checkpoints import convert, is_online, quantize_online, quantized_suffixes, weight_quant
from paged.models.registry import model_class

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


def resolve_model_path(model: str, weights: bool = True) -> str:
    """A local directory, else a hub id downloaded (config, tokenizer, and with `weights` the safetensors)."""
    if os.path.isdir(model):
        if not os.path.exists(os.path.join(model, "config.json")) and not is_gemma_checkpoint(model):
            raise ValueError(f"model directory {model!r} has no config.json")
        return model
    if os.path.exists(model):
        raise ValueError(f"model path {model!r} is a file; pass the checkpoint directory")
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ValueError(f"model path {model!r} does not exist")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, allow_patterns=[p for p in _HUB_PATTERNS
                                                        if weights or not p.endswith(".safetensors")])
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


def parameter_shapes(model) -> dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of every parameter the model needs: its global ones and its decoder layer's, stacked over
    layers (from the modules' own init)."""
    out = {key: (leaf.shape, np.dtype(leaf.dtype)) for key, leaf in _flat(nn.unbox(model.global_params())).items()}
    for key, leaf in _flat(nn.unbox(model.layer_params())).items():
        out[("layers", *key)] = ((model.config.num_layers, *leaf.shape), np.dtype(leaf.dtype))
    return out


def partition_specs(model) -> dict[tuple[str, ...], PartitionSpec]:
    """Each parameter's `PartitionSpec` over mesh axes (paged.models.linear), keyed as `parameter_shapes` is: the
    stacked layers' leading layer axis is not split."""
    specs = {key: spec for key, spec in _flat(nn.get_partition_spec(model.global_params())).items()}
    for key, spec in _flat(nn.get_partition_spec(model.layer_params())).items():
        specs[("layers", *key)] = PartitionSpec(None, *spec)
    return specs


def load_params(model_dir: str, model, config: ModelConfig, dtype: np.dtype, show_progress: bool = True,
                stacked_layers: bool = True, mesh=None, kv_head_replicas: int = 1, device=None):
    """Reads every tensor the model needs; returns the parameter tree on the default device.

    With `stacked_layers=False`, `params["layers"]` is a list of per-layer trees instead of one tree stacked
    over layers (for the unrolled layer loop; see models/layers.py `run_layers`). Each layer's arrays are
    copied to the device from views of the host buffer, so neither layout needs the weights twice.

    With a `mesh`, each array is split by its partition spec (`partition_specs`) as it goes to the devices:
    every device receives only its own slice. `kv_head_replicas` > 1 repeats each KV head of k_proj and v_proj
    that many times (the config already counts the copies). Without a mesh, `device` (default: the default
    device) receives every array.
    """
    expected_with_dtypes = parameter_shapes(model)
    expected = {key: shape for key, (shape, _) in expected_with_dtypes.items()}
    specs = partition_specs(model) if mesh is not None else {}
    params: dict = {}
    placer = _Placer(params, expected_with_dtypes, specs, stacked_layers, config.num_layers, mesh, device)
    files = [] if is_gemma_checkpoint(model_dir) else _safetensors_files(model_dir)
    scheme = config.weight_quant
    quantized_layers: dict[str, dict[str, np.ndarray]] = {}  # checkpoint prefix -> its packed tensors

    def offer(name: str, read) -> None:
        target = model.checkpoint_target(name)
        if target is None or target[0] not in expected:
            return  # e.g. rotary inv_freq buffers, or lm_head when tied
        key, index, transpose = target
        index = () if index is None else (index,) if isinstance(index, int) else tuple(index)
        tensor = read().T if transpose else read()
        if kv_head_replicas > 1 and key[-3:-1] in (("self_attn", "k_proj"), ("self_attn", "v_proj")) \
                and key[-1] != "perm":  # a quantized kernel's input order is the same for every head
            if key[-1] == "scales" and scheme is not None and scheme.block_out > 1:
                raise NotImplementedError(f"{name}: fp8 block scales over KV heads that tensor parallelism must "
                                          "repeat are not implemented; use a size that divides the KV heads")
            tensor = repeat_kv_heads(tensor, kv_head_replicas, config.head_dim)
        want = expected[key][len(index):]
        if want == () and tensor.size == 1:  # a scalar stored as [1] (KV cache scales)
            tensor = tensor.reshape(())
        if config.padded_vocab_size:
            tensor = _pad_vocab(tensor, want, config)
        tensor = to_declared_layout(tensor, want)
        if tensor.shape != want:
            raise ValueError(f"checkpoint tensor {name} has shape {tensor.shape} (after transpose: "
                             f"{transpose}); the config implies {want}")
        placer.place(key, index, np.asarray(tensor, expected_with_dtypes[key][1]))
        bar.update()

    def quantized_key(prefix: str) -> tuple[str, ...] | None:
        target = model.checkpoint_target(prefix + ".paged_qweight")
        return target[0] if target is not None and target[0] in expected else None

    with progress(desc="Loading weights", unit="tensor", disable=not show_progress) as bar:
        for f in _tensor_sources(model_dir, files):
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
            in_features, out_features = _quantized_layer_shape(expected, key, tensors, scheme)
            for part, array in convert(prefix, tensors, scheme, in_features, out_features, dtype).items():
                offer(f"{prefix}.paged_{part}", lambda array=array: array)
    for key, (shape, dtype) in expected_with_dtypes.items():
        if key[-1] in LORA_FACTORS:  # no checkpoint has them: the slots start empty
            for layer in range(shape[0]):
                placer.place(key, (layer,), np.zeros(shape[1:], dtype))
    missing = [".".join(k) for k in expected if _get(params, k) is None and _get_layer0(params, k) is None]
    if missing:
        raise ValueError(f"checkpoint in {model_dir!r} lacks tensors for: {', '.join(missing)}")
    return params


def _quantized_layer_shape(expected: dict, key: tuple[str, ...], tensors: dict[str, np.ndarray],
                           scheme) -> tuple[int, int]:
    """(in, out) of a quantized layer: from its declared codes, [layers, (experts,) rows, out] (int4: two rows a
    byte), or, where the module holds int8 or int4 codes packed for AMX (models/linear.py:
    `Linear.holds_int8_packed`, `holds_int4_packed`; [layers, out / 64, ceil(in / 64), 4096 or 2048]), from the
    checkpoint's tensors that fit that shape."""
    declared = expected[key]
    shape = None
    if "weight" in tensors and tensors["weight"].ndim == 2:  # compressed-tensors int-quantized: [out, in]
        shape = tensors["weight"].shape[::-1]
    elif "weight_shape" in tensors:  # compressed-tensors pack-quantized: [out, in]
        shape = tuple(int(v) for v in np.asarray(tensors["weight_shape"]).reshape(-1)[::-1])
    elif scheme.method == "gptq" and "qweight" in tensors and "scales" in tensors:  # [in * bits / 32, out]
        shape = (tensors["qweight"].shape[0] * 32 // scheme.bits, tensors["scales"].shape[-1])
    elif scheme.method == "awq" and "qweight" in tensors:  # [in, out * bits / 32]
        shape = (tensors["qweight"].shape[0], tensors["qweight"].shape[1] * 32 // scheme.bits)
    if shape is not None and scheme.bits in (4, 8):
        in_features, out_features = shape
        step = 4096 if scheme.bits == 8 else 2048
        if declared[-3:] == (out_features // 64, -(-in_features // 64), step) and declared[-2] != in_features:
            return in_features, out_features
    return declared[-2] * (2 if scheme.bits == 4 else 1), declared[-1]


def _tensor_sources(model_dir: str, files: list[str]):
    """Each source of named tensors (`keys()`, `get_tensor(name)`): the safetensors files, or a gemma-library
    checkpoint's tree under Hugging Face's names (models/gemma_checkpoint.py)."""
    if not files:
        yield HFTensors(read_gemma_arrays(model_dir))
        return
    for path in files:
        with safe_open(path, framework="np") as opened:
            yield _WithFloat8(opened, path)


class _Placer:
    """Puts each tensor on the devices as it is read, into the parameter tree.

    A tensor that is a whole parameter (or, with unstacked layers, a whole layer's) goes as it is. One that is
    a slice of a stacked parameter ([layers, ...], [layers, experts, ...] or, unstacked, a layer's [experts,
    ...]) is written into that parameter's device buffer, allocated with its final sharding at the first
    slice; the buffer is donated to each write, so the devices hold it once plus one slice.
    """

    def __init__(self, params: dict, expected: dict, specs: dict, stacked_layers: bool, num_layers: int,
                 mesh=None, device=None):
        self.params, self.expected, self.specs = params, expected, specs
        self.stacked_layers, self.num_layers, self.mesh, self.device = stacked_layers, num_layers, mesh, device
        self.buffers: dict[tuple, jax.Array] = {}  # (key, layer or None) -> its stacked buffer
        self.written: dict[tuple, int] = {}

    def _sharding(self, spec: PartitionSpec | None, shape: tuple[int, ...]):
        if self.mesh is None and self.device is None:
            return None  # the default device
        return _target_sharding(self.mesh, self.device, spec, shape)

    def place(self, key: tuple[str, ...], index: tuple[int, ...], tensor: np.ndarray) -> None:
        shape, dtype = self.expected[key]
        spec = self.specs.get(key)
        spec = tuple(spec) + (None,) * (len(shape) - len(spec)) if spec is not None else None
        layer = None
        if key[0] == "layers" and not self.stacked_layers:  # the unit is one layer's parameter
            layer, index, shape = index[0], index[1:], shape[1:]
            spec = spec[1:] if spec is not None else None
            tree = self.params.setdefault("layers", [{} for _ in range(self.num_layers)])[layer]
            path = key[1:]
        else:
            tree, path = self.params, key
        if not index:
            _put(tree, path, jax.device_put(tensor, self._sharding(PartitionSpec(*spec) if spec else None,
                                                                   tensor.shape)))
            return
        unit = (key, layer)
        if unit not in self.buffers:
            sharding = self._sharding(PartitionSpec(*spec) if spec else None, shape)
            self.buffers[unit] = jax.jit(lambda: jax.numpy.zeros(shape, dtype), out_shardings=sharding)()
            self.written[unit] = 0
        piece_spec = PartitionSpec(*spec[len(index):]) if spec else None
        piece = jax.device_put(tensor, self._sharding(piece_spec, tensor.shape))
        write = _slice_writer(self.buffers[unit].sharding)
        self.buffers[unit] = write(self.buffers[unit], piece, *(np.int32(i) for i in index))
        self.written[unit] += 1
        if self.written[unit] == int(np.prod(shape[:len(index)])):  # every layer (and expert) is in
            _put(tree, path, self.buffers.pop(unit))
            del self.written[unit]


@functools.lru_cache(maxsize=None)
def _slice_writer(sharding):
    """(buffer, piece, *index) -> buffer with buffer[index] = piece, in place (the buffer is donated) and kept
    in `sharding`; the indices are traced, so it compiles once per shape."""
    return jax.jit(lambda buffer, piece, *index: buffer.at[index].set(piece), donate_argnums=(0,),
                   out_shardings=sharding)


def _target_sharding(mesh, device, spec: PartitionSpec | None, shape: tuple[int, ...]):
    """Where a parameter lives: split over `mesh` by `spec` (splits the mesh cannot make evenly dropped), else
    on `device` (None: the default device)."""
    if mesh is None:
        return SingleDeviceSharding(device if device is not None else jax.devices()[0])
    return NamedSharding(mesh, _divisible(spec, shape, mesh))


def _divisible(spec: PartitionSpec | None, shape: tuple[int, ...], mesh) -> PartitionSpec:
    """`spec`, with every split the mesh cannot make evenly dropped (that dimension replicated), e.g. GPT-2's
    fused c_attn columns over sizes that do not divide them. Vocabulary tables are padded instead (load_model)."""
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
               linear_backend: str = "xla", mesh=None, quantization: str | None = None, device=None,
               kv_cache_scales: bool = False, hf_overrides: dict | None = None, lora=None,
               load_format: str = "auto"):
    """Returns (model_dir, config, model, params, numpy dtype); see load_params for `stacked_layers`, `mesh` and
    `device`, paged.models.linear for `linear_backend`, models/quantized_checkpoints.py for `quantization` (None: the
    checkpoint's own `quantization_config`, if any). `kv_cache_scales`: the KV pool is fp8, so the checkpoint's
    per-layer k/v scales are read where it has them (paged.models.llama.LlamaForCausalLM.KV_SCALE_RE). `lora`
    (paged.lora.LoRAConfig): every adapted projection gets its `max_loras` slots of LoRA factors, zeroed.
    `load_format`: "auto" (or vLLM's "safetensors") reads the checkpoint's weights; "dummy" draws random ones from
    config.json alone (models/dummy_weights.py)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {load_format!r}")
    dummy = load_format == "dummy"
    model_dir = resolve_model_path(model, weights=not dummy)
    config = load_model_config(model_dir, hf_overrides)
    cls = model_class(config.architecture)
    if config.classifier_from_tokens:
        config = dataclasses.replace(config, classifier_token_ids=_token_ids(model_dir, config.classifier_from_tokens))
    saved = read_layout(model_dir) if is_orbax_checkpoint(model_dir) and not dummy else None
    if saved is not None:  # paged's own Orbax checkpoint: its quantization is in its codes already
        scheme = WeightQuant(**saved.weight_quant) if saved.weight_quant is not None else None
        if quantization is not None and (scheme is None or quantization != scheme.method.split("-")[0]):
            raise ValueError(f"quantization={quantization!r}: this checkpoint was saved "
                             f"{'with ' + scheme.method if scheme else 'unquantized'}; its quantization is fixed")
        if dtype == "auto":
            dtype = saved.dtype
    else:
        scheme = weight_quant(_quantization_config(model_dir), quantization)
    if scheme is not None:
        if dummy:
            raise ValueError(f"load_format='dummy' draws float weights; {scheme.method} quantization needs its "
                             "checkpoint (use load_format='auto')")
        if cls.__name__ != "LlamaForCausalLM":
            raise NotImplementedError(f"quantized {config.architecture} models are not implemented yet")
        config = dataclasses.replace(config, weight_quant=scheme)
    size = int(np.prod(list(mesh.shape.values()))) if mesh is not None else 1
    if config.vocab_size % size:  # padded so the tables split evenly instead of being replicated
        config = dataclasses.replace(config, padded_vocab_size=-(-config.vocab_size // size) * size)
    if saved is not None:
        if saved.kv_scales and not kv_cache_scales:
            raise ValueError("this checkpoint was saved with fp8 KV cache scales: restore it with kv_cache_dtype "
                             "fp8 (or load the original checkpoint)")
        config = dataclasses.replace(config, kv_scales=saved.kv_scales)
    elif kv_cache_scales and cls.__name__ == "LlamaForCausalLM" and not dummy and \
            _has_kv_scales(model_dir, cls.KV_SCALE_RE):
        config = dataclasses.replace(config, kv_scales=True)
    if lora is not None:
        if cls.__name__ != "LlamaForCausalLM" or config.num_experts or config.encoder_only:
            raise NotImplementedError(f"LoRA adapters on {config.architecture} are not implemented (they are on the "
                                      "dense Llama-family decoders: Llama, Mistral, Qwen2/3, Phi-3, Gemma, GLM)")
        config = dataclasses.replace(config, lora_slots=lora.max_loras, lora_rank=lora.max_lora_rank)
    replicas = kv_head_replicas(config, mesh)
    if replicas > 1:  # the model is built with every KV head repeated; the loader repeats k/v_proj to match
        config = dataclasses.replace(config, num_kv_heads=config.num_kv_heads * replicas, kv_head_replicas=replicas)
    np_dtype = resolve_dtype(dtype, config)
    instance = cls(config, np_dtype, linear_backend=linear_backend)
    if dummy:
        params = dummy_params(parameter_shapes(instance), partition_specs(instance) if mesh is not None else {},
                              functools.partial(_target_sharding, mesh, device), config.norm_plus_one,
                              stacked_layers, config.num_layers, (config.vocab_size, config.padded_vocab_size))
    elif saved is not None:
        expected = parameter_shapes(instance)
        specs = partition_specs(instance) if mesh is not None else {}
        shardings = {key: _target_sharding(mesh, device, specs.get(key), shape) for key, (shape, _) in
                     expected.items()}
        lora_keys = [key for key in expected if key[-1] in LORA_FACTORS]  # never saved: the slots start empty
        params = restore_params(model_dir, {k: v for k, v in expected.items() if k not in lora_keys}, shardings,
                                saved, saved_layout(config, np_dtype, mesh), stacked_layers)
        for key in lora_keys:
            shape, dtype = expected[key]
            if stacked_layers:
                _put(params, key, jax.device_put(np.zeros(shape, dtype), shardings[key]))
                continue
            layer_sharding = _target_sharding(mesh, device, PartitionSpec(*tuple(specs[key])[1:]) if key in specs
                                              else None, shape[1:])
            for layer_tree in params["layers"]:
                _put(layer_tree, key[1:], jax.device_put(np.zeros(shape[1:], dtype), layer_sharding))
    else:
        params = load_params(model_dir, instance, config, np_dtype, show_progress, stacked_layers, mesh,
                             replicas, device)
    return model_dir, config, instance, params, np_dtype


def _token_ids(model_dir: str, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """The ids of a classifier's tokens (classifier_from_token), each a single token of the model's tokenizer."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = []
    for token in tokens:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"classifier_from_token {token!r} is {len(encoded)} tokens of this tokenizer, not one")
        ids.append(encoded[0])
    return tuple(ids)


def saved_layout(config: ModelConfig, dtype: np.dtype, mesh) -> SavedLayout:
    """The layout of the tree a model loaded with `config` holds (what an Orbax save records)."""
    return SavedLayout(dtype=np.dtype(dtype).name, padded_vocab_size=config.padded_vocab_size or None,
                       weight_quant=dataclasses.asdict(config.weight_quant) if config.weight_quant else None,
                       kv_head_replicas=config.kv_head_replicas, kv_scales=config.kv_scales,
                       tensor_parallel_size=int(np.prod(list(mesh.shape.values()))) if mesh is not None else 1)


def _has_kv_scales(model_dir: str, pattern) -> bool:
    """Whether the checkpoint holds per-layer KV cache scales (read from the safetensors headers only)."""
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="np") as f:
            if any(pattern.match(name) for name in f.keys()):
                return True
    return False


def kv_head_replicas(config: ModelConfig, mesh) -> int:
    """How many devices share each KV head: mesh size / KV heads when there are fewer KV heads than devices."""
    if mesh is None:
        return 1
    size = int(np.prod(list(mesh.shape.values())))
    return size // config.num_kv_heads if config.num_kv_heads < size else 1


def _pad_vocab(tensor: np.ndarray, want: tuple[int, ...], config: ModelConfig) -> np.ndarray:
    """An embedding or LM-head tensor with zero rows appended up to the padded vocabulary (other tensors,
    and tensors whose other dimensions do not match, unchanged: the shape check then reports them)."""
    pad = [(0, w - t) if (t, w) == (config.vocab_size, config.padded_vocab_size) else (0, 0)
           for t, w in zip(tensor.shape, want)]
    if len(tensor.shape) != len(want) or not any(p[1] for p in pad):
        return tensor
    return np.pad(tensor, pad)


def repeat_kv_heads(tensor: np.ndarray, replicas: int, head_dim: int) -> np.ndarray:
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
    if is_gemma_checkpoint(model_dir):
        return None
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
