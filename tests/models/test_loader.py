"""Checkpoint loading: config spellings, sharded safetensors, dtypes, errors."""

from __future__ import annotations

import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from paged.models import load_model, model_config_from_hf, resolve_dtype
from paged import LLM, SamplingParams

BASE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=100, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_transformers4_and_5_rope_spellings_agree():
    v4 = model_config_from_hf({**BASE, "rope_theta": 500000.0, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, "torch_dtype": "bfloat16"})
    v5 = model_config_from_hf({**BASE, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, "dtype": "bfloat16"})
    assert v4 == v5
    assert v4.rope.rope_type == "llama3" and v4.rope.theta == 500000.0 and v4.checkpoint_dtype == "bfloat16"
    # Scaling leaves the highest frequencies alone and divides the lowest by `factor`.
    plain = model_config_from_hf({**BASE, "rope_theta": 500000.0}).rope.inv_freq(16)
    scaled = v4.rope.inv_freq(16)
    assert scaled[0] == plain[0] and np.isclose(scaled[-1], plain[-1] / 8.0)


def test_gemma3_spellings_agree():
    """Gemma 3 in transformers 4 (rope_local_base_freq, sliding_window_pattern) and 5 (per-layer-type rope)."""
    gemma = {**BASE, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 6,
             "sliding_window": 512, "query_pre_attn_scalar": 256}
    v4 = model_config_from_hf({**gemma, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 6,
                               "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    v5 = model_config_from_hf({**gemma, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
                               "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                      "rope_theta": 1e6},
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert v4 == v5
    assert v4.layer_windows == (512,) * 5 + (0,)
    assert (v4.rope.theta, v4.rope.rope_type, v4.rope.factor) == (1e6, "linear", 8.0)
    assert (v4.local_rope.theta, v4.local_rope.rope_type) == (1e4, "default")
    assert v4.qk_norm and v4.norm_plus_one and v4.sandwich_norms


def test_unsupported_rope_scaling_is_a_clear_error():
    with pytest.raises(NotImplementedError, match="'mrope' is not supported yet; supported: .*yarn, dynamic, longrope"):
        model_config_from_hf({**BASE, "rope_scaling": {"rope_type": "mrope", "mrope_section": [2, 3, 3]}})


YARN_CASES = {
    "qwen": {"factor": 4.0, "original_max_position_embeddings": 32},
    "mscale": {"factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 0.707,
               "beta_fast": 16, "beta_slow": 2},
    "mscale-differs": {"factor": 40.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                       "mscale_all_dim": 0.5},
    "attention-factor": {"factor": 2.0, "original_max_position_embeddings": 128, "attention_factor": 1.25},
    "untruncated": {"factor": 4.0, "original_max_position_embeddings": 32, "truncate": False},
    "factor-from-lengths": {"factor": None, "original_max_position_embeddings": 256},  # DeepSeek-V3 style
}


@pytest.mark.torch
@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_yarn_frequencies_and_attention_factor_are_transformers(case):
    """inv_freq and the cos/sin scale against transformers' own YaRN initialiser, from both config spellings."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = YARN_CASES[case]
    hf = LlamaConfig(**{k: v for k, v in BASE.items() if k not in ("architectures", "model_type")},
                     max_position_embeddings=1024,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **params})
    want_inv_freq, want_scaling = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    v5 = model_config_from_hf({**BASE, "max_position_embeddings": 1024,
                               "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, **params}})
    v4 = model_config_from_hf({**BASE, "max_position_embeddings": 1024, "rope_theta": 10000.0,
                               "rope_scaling": {"type": "yarn", **params}})
    assert v4 == v5
    np.testing.assert_array_equal(v5.rope.inv_freq(16), want_inv_freq.numpy())
    assert v5.rope.attention_scaling == pytest.approx(want_scaling, rel=1e-12)


def test_sharded_checkpoint_loads_like_single_file(tiny_model_dir, tmp_path):
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir, sharded)
    os.remove(sharded / "model.safetensors")
    tensors = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, group in halves.items():
        save_file({n: tensors[n] for n in group}, sharded / file)
        weight_map.update({n: file for n in group})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    *_, single, _ = load_model(tiny_model_dir, show_progress=False)
    *_, split, _ = load_model(str(sharded), show_progress=False)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), single, split)


def test_unstacked_layers_hold_the_stacked_slices(tiny_model_dir):
    *_, stacked, _ = load_model(tiny_model_dir, show_progress=False)
    *_, unstacked, _ = load_model(tiny_model_dir, show_progress=False, stacked_layers=False)
    layers = unstacked.pop("layers")
    stacked_layers = stacked.pop("layers")
    assert isinstance(layers, list) and len(layers) == jax.tree.leaves(stacked_layers)[0].shape[0]
    for index, layer in enumerate(layers):
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[index]),
                     layer, stacked_layers)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), unstacked, stacked)


@pytest.mark.parametrize("spelling, expected", [
    ("auto", np.float32), ("float", np.float32), ("float32", np.float32), ("half", np.float16),
    ("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)])
def test_dtype_spellings(tiny_model_dir, spelling, expected):
    *_, params, dtype = load_model(tiny_model_dir, dtype=spelling, show_progress=False)
    assert dtype == np.dtype(expected)
    assert all(leaf.dtype == np.dtype(expected) for leaf in jax.tree.leaves(params))


def test_bfloat16_generation_tracks_float32(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompts = ["Hello world", "The quick brown fox", "Paged attention", "JAX compiles"]
    runs = []
    for dtype in ("float32", "bfloat16"):
        llm = LLM(tiny_model_dir, dtype=dtype, block_size=8, max_model_len=64, show_progress=False)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.engine.worker.runner.kv_cache[0].dtype == np.dtype(dtype)
    assert runs[0] == runs[1]


def test_missing_tensor_and_bad_shapes_are_reported(tiny_model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match="layers.mlp.up_proj.kernel"):
        load_model(str(broken), show_progress=False)
    tensors = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    tensors["model.norm.weight"] = np.ones(3, np.float32)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        load_model(str(broken), show_progress=False)


def test_unknown_dtype_and_unreachable_hub_id(monkeypatch):
    cfg = model_config_from_hf(BASE)
    with pytest.raises(ValueError, match="int4"):
        resolve_dtype("int4", cfg)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="could not be fetched"):
        load_model("some-org/not-a-real-model", show_progress=False)


LONGROPE = {"short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 3.0, 4.0, 5.0],
            "long_factor": [1.0, 1.3, 2.0, 4.0, 8.0, 12.0, 16.0, 20.0], "original_max_position_embeddings": 64}


@pytest.mark.torch
def test_longrope_frequencies_and_attention_factor_are_transformers():
    """Phi-3's spellings (transformers 4: rope_scaling of type "su" or "longrope" with the original length at
    the top level; 5: rope_parameters), against transformers' own LongRoPE initialiser."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf = LlamaConfig(**{k: v for k, v in BASE.items() if k not in ("architectures", "model_type")},
                     max_position_embeddings=1024, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                                    **LONGROPE})
    v5 = model_config_from_hf({**BASE, "max_position_embeddings": 1024,
                               "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, **LONGROPE}})
    top = {k: v for k, v in LONGROPE.items() if k != "original_max_position_embeddings"}
    for kind in ("su", "longrope"):
        v4 = model_config_from_hf({**BASE, "max_position_embeddings": 1024, "rope_theta": 10000.0,
                                   "original_max_position_embeddings": 64, "rope_scaling": {"type": kind, **top}})
        assert v4 == v5
    rope = v5.rope
    for seq_len, long in ((64, False), (65, True)):
        want, scaling = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=seq_len)
        np.testing.assert_array_equal(rope.longrope_inv_freq(16, long=long), want.numpy())
        assert rope.attention_scaling == pytest.approx(scaling, rel=1e-12)
    assert rope.length_class(64) is None and rope.length_class(65) == "longrope:long"
    assert v5.max_context_len == 1024  # LongRoPE configs state the extended length themselves


@pytest.mark.torch
@pytest.mark.parametrize("length", [10, 128, 129, 500, 1000])
def test_dynamic_ntk_frequencies_follow_the_length_as_transformers(length):
    import jax.numpy as jnp
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from paged.models.layers import rotary_cos_sin_by_length
    params = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    hf = LlamaConfig(**{k: v for k, v in BASE.items() if k not in ("architectures", "model_type")},
                     max_position_embeddings=128, rope_parameters=params)
    config = model_config_from_hf({**BASE, "max_position_embeddings": 128, "rope_parameters": params})
    assert config.max_context_len == 512 and config.rope.length_dependent
    import torch
    want_inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=torch.tensor(length))
    positions = np.arange(0, length, max(1, length // 7))
    want = positions[:, None].astype(np.float64) * want_inv_freq.numpy().astype(np.float64)[None, :]
    cos, sin = rotary_cos_sin_by_length(jnp.asarray(positions), jnp.full(len(positions), length), config.rope, 16)
    np.testing.assert_allclose(np.asarray(cos)[:, :8], np.cos(want), atol=2e-5)
    np.testing.assert_allclose(np.asarray(sin)[:, :8], np.sin(want), atol=2e-5)
    if length <= 128:
        np.testing.assert_array_equal(want_inv_freq.numpy(), config.rope.inv_freq(16))
