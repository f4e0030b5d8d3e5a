"""Random weights in a model's shapes, drawn on the devices that hold them: `load_format="dummy"`.

What vLLM's `--load-format dummy` is for: timing a model at its real size from its config.json alone, with no
checkpoint to download or write (an 8B model's 16 GB never touch a disk or the host's memory). Each parameter
is drawn by a jitted function whose output sharding is the parameter's own, so every device computes only its
slice. The values follow the modules' own initializers, so activations stay in range over many layers: norm
scales one (zero where the model adds one to them), biases and LoRA slots zero, fp8 KV scales one, every other
float parameter normal with std 0.02 (Hugging Face's `initializer_range`). Tokens from such weights mean
nothing; their speed is the model's.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import unflatten_dict
from jax.sharding import PartitionSpec

_STD = 0.02


def _kind(key: tuple[str, ...], dtype: np.dtype, norm_plus_one: bool) -> str:
    """How parameter `key` is drawn: "ones", "zeros" or "normal"."""
    name = key[-1]
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"load_format='dummy' draws float weights; {'.'.join(key)} is {np.dtype(dtype).name} "
                         "(quantized weights need their checkpoint)")
    if name == "scale":  # RMSNorm / LayerNorm scales
        return "zeros" if norm_plus_one else "ones"
    if name in ("k_scale", "v_scale"):
        return "ones"
    if name in ("bias", "lora_a", "lora_b"):
        return "zeros"
    return "normal"


@functools.lru_cache(maxsize=None)
def _drawer(shape: tuple[int, ...], dtype: np.dtype, kind: str, sharding, stacked: bool,
            drawn: tuple[int, ...] | None = None):
    """A jitted function of one key (or, `stacked`, of one key per layer: [L] keys for shape [L, ...]) -> the
    array drawn as `kind`, computed where `sharding` puts it (None: the default device). A stacked array's
    layer i is what layer i's key draws alone, so both layer layouts hold the same weights. `drawn`: a smaller
    shape drawn and then padded with zeros up to `shape` (a vocabulary padded for tensor parallelism)."""
    def one(key, shape):
        if kind == "ones":
            return jnp.ones(shape, dtype)
        if kind == "zeros":
            return jnp.zeros(shape, dtype)
        return jax.random.normal(key, shape, dtype) * jnp.asarray(_STD, dtype)  # no float32 copy of a 4 GB stack

    def padded(key):
        values = one(key, drawn)
        return jnp.pad(values, [(0, want - got) for want, got in zip(shape, drawn)])

    draw = (lambda keys: jax.vmap(lambda key: one(key, shape[1:]))(keys)) if stacked else \
        padded if drawn is not None else (lambda key: one(key, shape))
    return jax.jit(draw, out_shardings=sharding)


def dummy_params(expected: dict, specs: dict, sharding_for, norm_plus_one: bool, stacked_layers: bool,
                 num_layers: int, vocab: tuple[int, int | None] = (0, None), seed: int = 0) -> dict:
    """The parameter tree, every leaf drawn on its devices.

    expected: key -> (shape, dtype), as models/loader.py `parameter_shapes` gives (layers stacked: [L, ...]);
    specs: key -> PartitionSpec (empty without a mesh); sharding_for(spec or None, shape) -> where the array
    lives. With `stacked_layers=False`, params["layers"] is a list of per-layer trees, as the loader builds.
    vocab: (the vocabulary, its size padded for tensor parallelism or None): a table's padding rows are zeros
    past the rows one device draws, as a checkpoint's are (models/loader.py `_pad_vocab`), so the weights are
    the same on every mesh."""
    flat: dict = {}
    layers: list[dict] = [{} for _ in range(num_layers)]
    root = jax.random.key(seed)
    for key, (shape, dtype) in expected.items():
        kind = _kind(key, np.dtype(dtype), norm_plus_one)
        spec = tuple(specs[key]) if key in specs else None
        # Keyed by name: LoRA slots or KV scales added to a model leave its other weights as they were.
        leaf_key = jax.random.fold_in(root, zlib.crc32("/".join(key).encode()) & 0x7FFFFFFF)
        shape = tuple(shape)
        if key[0] != "layers":
            sharding = sharding_for(PartitionSpec(*spec) if spec else None, shape)
            drawn = tuple(vocab[0] if vocab[1] and n == vocab[1] else n for n in shape)
            flat[key] = _drawer(shape, np.dtype(dtype), kind, sharding, False,
                                drawn if drawn != shape else None)(leaf_key)
            continue
        layer_keys = jax.vmap(lambda i: jax.random.fold_in(leaf_key, i))(jnp.arange(num_layers))
        if stacked_layers:
            sharding = sharding_for(PartitionSpec(*spec) if spec else None, shape)
            flat[key] = _drawer(shape, np.dtype(dtype), kind, sharding, True)(layer_keys)
            continue
        sharding = sharding_for(PartitionSpec(*spec[1:]) if spec else None, shape[1:])
        draw = _drawer(shape[1:], np.dtype(dtype), kind, sharding, False)
        for layer in range(num_layers):
            layers[layer][key[1:]] = draw(layer_keys[layer])
    params = unflatten_dict(flat)
    if not stacked_layers and any(layers):
        params["layers"] = [unflatten_dict(layer) for layer in layers]
    return params
