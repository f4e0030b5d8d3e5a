"""Checkpoints of Google's `gemma` library (JAX): Gemma 2 and Gemma 3 text models saved with
`gm.ckpts.save_params`, served without a conversion to Hugging Face's format.

Such a checkpoint is an Orbax directory holding only the parameter tree: in the library's own nested layout
(`embedder/input_embedding`, `layer_{i}/attn/q_einsum/w`, ...; what `save_params(params)` writes) or the flat
layout of the released checkpoints (`transformer/layer_{i}/attn/q_einsum` -> {"w": ...}). No config, no
tokenizer: the model's shape is read from the tree's shapes, the rest of its configuration (windows, rope
bases and scaling, query scaling, soft caps) from the library's definitions of each released size, and the
tokenizer comes from `tokenizer=` (e.g. a Hub Gemma's). A checkpoint of another shape states what differs
through `hf_overrides`, in Hugging Face's config names.

The tensors are handed to the loader under Hugging Face's Gemma names (`as_hf_tensors`), so everything after
(sharding, quantization, the layer layout) is the path every checkpoint takes.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

_ORBAX_MARKER = "_CHECKPOINT_METADATA"


def is_gemma_checkpoint(model_dir: str) -> bool:
    """An Orbax directory without paged's layout file or a config.json, whose tree has a gemma embedder."""
    from paged.models.orbax_checkpoint import LAYOUT_FILE
    if not os.path.isfile(os.path.join(model_dir, _ORBAX_MARKER)) or \
            os.path.exists(os.path.join(model_dir, LAYOUT_FILE)) or os.path.exists(os.path.join(model_dir, "config.json")):
        return False
    return "embedder/input_embedding" in _shapes(model_dir)


def _restorer():
    import orbax.checkpoint as ocp
    return ocp


def _normalised(flat: dict[str, Any]) -> dict[str, Any]:
    """The library's nested names whichever layout was saved: `transformer/` dropped, and the flat layout's
    `{"w": ...}` under the MLP's two matrices (which the nested layout holds as leaves) unwrapped."""
    out = {}
    for name, value in flat.items():
        name = name.removeprefix("transformer/")
        if name.endswith(("/mlp/gating_einsum/w", "/mlp/linear/w")):
            name = name[:-len("/w")]
        out[name] = value
    return out


def _flatten(tree, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        out.update(_flatten(value, name) if isinstance(value, dict) else {name: value})
    return out


def _shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape, from the checkpoint's metadata (no array is read)."""
    ocp = _restorer()
    meta = ocp.StandardCheckpointer().metadata(os.path.abspath(model_dir))
    tree = getattr(meta, "item_metadata", meta)
    return {name: tuple(leaf.shape) for name, leaf in _normalised(_flatten(dict(tree))).items()}


def read_arrays(model_dir: str) -> dict[str, np.ndarray]:
    """Every parameter as a host array (ml_dtypes' bfloat16 where it was saved so), by normalised name. Read
    as numpy whatever device the checkpoint was written from (its recorded sharding names that device)."""
    import jax
    ocp = _restorer()
    path = os.path.abspath(model_dir)
    meta = ocp.StandardCheckpointer().metadata(path)
    tree = dict(getattr(meta, "item_metadata", meta))
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    restored = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
    return _normalised(_flatten(restored))


# The released sizes' settings that the tree's shapes do not show, from the library's model definitions
# (gemma/gm/nn/_gemma.py), keyed by (generation, embed_dim).
_GEMMA3 = {640: dict(window=512, global_scale=1.0, max_len=32768),  # 270M
           1152: dict(window=512, global_scale=1.0, max_len=32768),  # 1B
           2560: dict(window=1024, global_scale=8.0, max_len=131072),  # 4B
           3840: dict(window=1024, global_scale=8.0, max_len=131072),  # 12B
           5376: dict(window=1024, global_scale=8.0, max_len=131072, query_scale_by_width=True)}  # 27B
_GEMMA2 = {2304: dict(), 3584: dict(), 4608: dict(query_scale_by_width=True)}  # 2B, 9B, 27B


def hf_config(model_dir: str) -> dict[str, Any]:
    """A Hugging Face config.json's fields for the checkpoint (Gemma3ForCausalLM or Gemma2ForCausalLM), from its
    shapes and the released sizes' settings (a size the library does not define keeps Gemma's defaults for
    its generation: override what differs with hf_overrides)."""
    shapes = _shapes(model_dir)
    vocab, width = shapes["embedder/input_embedding"]
    layers = sorted({int(name.split("/")[0][len("layer_"):]) for name in shapes if name.startswith("layer_")})
    first = "layer_0/attn/"
    if first + "qkv_einsum/w" in shapes:
        _, heads, _, head_dim = shapes[first + "qkv_einsum/w"]
        kv_heads = heads
    else:
        heads, _, head_dim = shapes[first + "q_einsum/w"]
        kv_heads = shapes[first + "kv_einsum/w"][1]
    gating = shapes["layer_0/mlp/gating_einsum"]
    inner = gating[1] if gating[2] == width else gating[2]
    gemma3 = first + "_query_norm/scale" in shapes
    raw: dict[str, Any] = dict(vocab_size=vocab, hidden_size=width, intermediate_size=inner,
                               num_hidden_layers=len(layers), num_attention_heads=heads, num_key_value_heads=kv_heads,
                               head_dim=head_dim, rms_norm_eps=1e-6, tie_word_embeddings=True,
                               hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1, pad_token_id=0,
                               torch_dtype="bfloat16")
    if gemma3:
        known = _GEMMA3.get(width, dict(window=1024, global_scale=1.0, max_len=131072))
        scaling = {"rope_type": "linear", "factor": known["global_scale"]} if known["global_scale"] != 1.0 else None
        raw.update(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window=known["window"],
                   sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                   rope_scaling=scaling, max_position_embeddings=known["max_len"],
                   final_logit_softcapping=None, attn_logit_softcapping=None)
    else:
        known = _GEMMA2.get(width, {})
        raw.update(architectures=["Gemma2ForCausalLM"], model_type="gemma2", sliding_window=4096,
                   rope_theta=10_000.0, max_position_embeddings=8192, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0)
    # The library scales queries by head_dim ** -0.5, except the 27B sizes: (width / heads) ** -0.5. Hugging
    # Face's query_pre_attn_scalar is the number under the root.
    raw["query_pre_attn_scalar"] = width // heads if known.get("query_scale_by_width") else head_dim
    return raw


class HFTensors:
    """The checkpoint's tensors under Hugging Face's Gemma names, as the loader reads a safetensors file
    (`keys()`, `get_tensor(name)`); each is converted when read."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self._readers: dict[str, Callable[[], np.ndarray]] = {}
        width = arrays["embedder/input_embedding"].shape[1]
        add = self._readers.__setitem__
        add("model.embed_tokens.weight", lambda: arrays["embedder/input_embedding"])
        add("model.norm.weight", lambda: arrays["final_norm/scale"])
        layers = sorted({int(name.split("/")[0][len("layer_"):]) for name in arrays if name.startswith("layer_")})
        norms = {"pre_attention_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                 "pre_ffw_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
        for i in layers:
            src, dst = f"layer_{i}/", f"model.layers.{i}."
            for theirs, ours in norms.items():
                if src + theirs + "/scale" in arrays:
                    add(f"{dst}{ours}.weight", lambda key=src + theirs + "/scale": arrays[key])
            attn = src + "attn/"
            # [heads, width, head_dim] -> Hugging Face's [heads * head_dim, width]
            heads_first = lambda w: np.ascontiguousarray(w.transpose(0, 2, 1).reshape(-1, w.shape[1]))
            if attn + "qkv_einsum/w" in arrays:
                for index, name in enumerate(("q_proj", "k_proj", "v_proj")):
                    add(f"{dst}self_attn.{name}.weight",
                        lambda key=attn + "qkv_einsum/w", index=index: heads_first(arrays[key][index]))
            else:
                add(f"{dst}self_attn.q_proj.weight", lambda key=attn + "q_einsum/w": heads_first(arrays[key]))
                for index, name in enumerate(("k_proj", "v_proj")):  # kv_einsum: index 0 is k, 1 is v
                    add(f"{dst}self_attn.{name}.weight",
                        lambda key=attn + "kv_einsum/w", index=index: heads_first(arrays[key][index]))
            add(f"{dst}self_attn.o_proj.weight",  # [heads, head_dim, width] -> [width, heads * head_dim]
                lambda key=attn + "attn_vec_einsum/w": np.ascontiguousarray(arrays[key].reshape(-1, width).T))
            for theirs, ours in (("_query_norm", "q_norm"), ("_key_norm", "k_norm")):
                if attn + theirs + "/scale" in arrays:
                    add(f"{dst}self_attn.{ours}.weight", lambda key=attn + theirs + "/scale": arrays[key])
            gating = src + "mlp/gating_einsum"
            # [2, inner, width] (or [2, width, inner], older Gemma 2 sizes): index 0 the gate, 1 the up projection
            as_out_in = lambda w: w.transpose(0, 2, 1) if w.shape[1] == width and w.shape[2] != width else w
            add(f"{dst}mlp.gate_proj.weight", lambda key=gating: np.ascontiguousarray(as_out_in(arrays[key])[0]))
            add(f"{dst}mlp.up_proj.weight", lambda key=gating: np.ascontiguousarray(as_out_in(arrays[key])[1]))
            add(f"{dst}mlp.down_proj.weight",  # linear: [inner, width] -> [width, inner]
                lambda key=src + "mlp/linear": np.ascontiguousarray(arrays[key].T))

    def keys(self):
        return list(self._readers)

    def get_tensor(self, name: str) -> np.ndarray:
        return self._readers[name]()
