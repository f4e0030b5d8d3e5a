"""load_format="dummy": random weights drawn on the devices from config.json alone, in the tree, shapes, dtypes
and placements a checkpoint load gives (vLLM's --load-format dummy)."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from paged import LLM, SamplingParams
from paged.models.loader import load_model
from paged.models.tiny import create_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_llama(str(tmp_path_factory.mktemp("llama")), num_heads=8, num_kv_heads=4, hidden_size=64,
                             num_layers=2)


def _without_weights(model_dir: str, out: str, **config_changes) -> str:
    """The checkpoint's config and tokenizer, no safetensors."""
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**config, **config_changes}, f)
    return out


@pytest.fixture(scope="module")
def config_only(model_dir, tmp_path_factory):
    return _without_weights(model_dir, str(tmp_path_factory.mktemp("config-only") / "llama"))


@pytest.fixture(scope="module")
def qwen2_config_only(model_dir, tmp_path_factory):
    """A Qwen2 (q/k/v biases) from the same config, weights never written."""
    return _without_weights(model_dir, str(tmp_path_factory.mktemp("config-only") / "qwen2"),
                            architectures=["Qwen2ForCausalLM"], model_type="qwen2")


def _leaves(params) -> dict:
    return {key: leaf for key, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


@pytest.mark.parametrize("stacked", [True, False])
def test_the_tree_is_a_checkpoint_loads(model_dir, config_only, stacked):
    """Every parameter a checkpoint load gives, with its shape, dtype and device: only the values differ."""
    real = _leaves(load_model(model_dir, dtype="bfloat16", show_progress=False, stacked_layers=stacked)[3])
    dummy = _leaves(load_model(config_only, dtype="bfloat16", show_progress=False, stacked_layers=stacked,
                               load_format="dummy")[3])
    assert sorted(map(str, dummy)) == sorted(map(str, real))
    for path, leaf in real.items():
        got = dummy[path]
        assert (got.shape, got.dtype, got.sharding) == (leaf.shape, leaf.dtype, leaf.sharding), path


def test_the_values_follow_the_modules_initializers(qwen2_config_only):
    """Norm scales one, biases zero, every matrix normal with std 0.02 (checked in float64), each drawn apart."""
    params = flatten_dict(load_model(qwen2_config_only, dtype="float32", show_progress=False,
                                     load_format="dummy")[3])
    assert ("layers", "self_attn", "q_proj", "bias") in params  # Qwen2's biases are there to check
    matrices = []
    for key, leaf in params.items():
        values = np.asarray(leaf, np.float64)
        if key[-1] == "scale":
            assert np.all(values == 1.0), key
        elif key[-1] == "bias":
            assert np.all(values == 0.0), key
        else:
            assert values.std() == pytest.approx(0.02, rel=0.1) and abs(values.mean()) < 0.002, key
            matrices.append(values.ravel()[:256])
    # No two matrices (nor two layers of one) share their draws.
    layers = np.asarray(params[("layers", "mlp", "up_proj", "kernel")], np.float64)
    assert not np.array_equal(layers[0], layers[1])
    assert len({m.tobytes() for m in matrices}) == len(matrices)


def test_both_layer_layouts_and_every_load_hold_the_same_weights(config_only):
    stacked = flatten_dict(load_model(config_only, show_progress=False, stacked_layers=True,
                                      load_format="dummy")[3])
    again = flatten_dict(load_model(config_only, show_progress=False, stacked_layers=True, load_format="dummy")[3])
    unstacked = load_model(config_only, show_progress=False, stacked_layers=False, load_format="dummy")[3]
    for key, leaf in stacked.items():
        np.testing.assert_array_equal(np.asarray(again[key]), np.asarray(leaf))
        if key[0] == "layers":
            for layer, tree in enumerate(unstacked["layers"]):
                np.testing.assert_array_equal(np.asarray(flatten_dict(tree)[key[1:]]), np.asarray(leaf[layer]))


def test_an_engine_serves_from_config_json_alone(config_only):
    small = dict(block_size=8, max_model_len=64, num_kv_blocks=16, max_num_seqs=4, show_progress=False)
    with pytest.raises(ValueError, match="no .safetensors files"):
        LLM(config_only, **small)
    llm = LLM(config_only, load_format="dummy", **small)
    out = llm.generate([{"prompt_token_ids": [5, 9, 13]}], SamplingParams(temperature=0, max_tokens=6,
                                                                          ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


def test_what_dummy_weights_cannot_be_is_refused(model_dir, config_only, tmp_path):
    with pytest.raises(ValueError, match="int8 quantization needs its checkpoint"):
        load_model(config_only, quantization="int8", show_progress=False, load_format="dummy")
    gptq = _without_weights(model_dir, str(tmp_path / "gptq"), quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False})
    with pytest.raises(ValueError, match="needs its checkpoint"):
        load_model(gptq, show_progress=False, load_format="dummy")
    with pytest.raises(ValueError, match="load_format must be 'auto', 'safetensors' or 'dummy', got 'pt'"):
        LLM(config_only, load_format="pt", show_progress=False)
