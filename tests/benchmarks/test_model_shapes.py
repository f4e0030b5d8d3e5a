"""`--model-shape`: random checkpoints with a real model's config, read by this engine and by transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paged.benchmarks import shapes
from tests.native import cache_root_sharing_kernels


def _register_small(monkeypatch, tmp_path, like: str, name: str, **changes) -> None:
    """An entry `name` shaped like `like` but small enough for a test, built under a temporary cache root."""
    monkeypatch.setenv("PAGED_CACHE_DIR", str(cache_root_sharing_kernels(tmp_path)))
    config = dict(shapes.MODEL_SHAPES[like], vocab_size=600, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    monkeypatch.setitem(shapes.MODEL_SHAPES, name, {**config, **changes})


@pytest.fixture
def tiny_shape(monkeypatch, tmp_path):
    """A Qwen2-shaped entry."""
    _register_small(monkeypatch, tmp_path, "qwen2.5-0.5b", "tiny-qwen2")
    return shapes.model_shape_dir("tiny-qwen2")


@pytest.fixture
def tiny_qwen3_shape(monkeypatch, tmp_path):
    """A Qwen3-shaped entry (head_dim given apart from hidden_size, q/k norms, no biases)."""
    _register_small(monkeypatch, tmp_path, "qwen3-0.6b", "tiny-qwen3", head_dim=32)
    return shapes.model_shape_dir("tiny-qwen3")


def test_the_real_shape_has_the_published_size():
    c = shapes.MODEL_SHAPES["qwen2.5-0.5b"]
    head = c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    per_layer = (c["hidden_size"] * (q + 2 * kv) + q + 2 * kv + q * c["hidden_size"]
                 + 3 * c["hidden_size"] * c["intermediate_size"] + 2 * c["hidden_size"])
    total = c["vocab_size"] * c["hidden_size"] + c["num_hidden_layers"] * per_layer + c["hidden_size"]
    assert round(total / 1e6) == 494  # Qwen2.5-0.5B: 0.49B parameters (tied embeddings)


def test_shape_checkpoint_is_bfloat16_and_built_once(tiny_shape):
    from safetensors import safe_open
    with safe_open(f"{tiny_shape}/model.safetensors", "np") as f:
        assert {f.get_tensor(k).dtype.name for k in f.keys()} == {"bfloat16"}
        assert "lm_head.weight" not in f.keys()  # tied
    assert json.load(open(f"{tiny_shape}/config.json"))["architectures"] == ["Qwen2ForCausalLM"]
    assert shapes.model_shape_dir("tiny-qwen2") == tiny_shape
    with pytest.raises(ValueError, match="unknown model shape"):
        shapes.model_shape_dir("no-such-model")


def test_the_qwen3_shape_has_the_published_size():
    c = shapes.MODEL_SHAPES["qwen3-0.6b"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    per_layer = (c["hidden_size"] * (q + 2 * kv) + q * c["hidden_size"] + 3 * c["hidden_size"] * c["intermediate_size"]
                 + 2 * c["hidden_size"] + 2 * c["head_dim"])
    total = c["vocab_size"] * c["hidden_size"] + c["num_hidden_layers"] * per_layer + c["hidden_size"]
    assert round(total / 1e6) == 596  # Qwen3-0.6B: 0.6B parameters (tied embeddings)


@pytest.mark.torch
@pytest.mark.parametrize("shape", ["tiny_shape", "tiny_qwen3_shape"])
def test_shape_checkpoint_reads_the_same_in_transformers(shape, request):
    tiny_shape = request.getfixturevalue(shape)
    torch = pytest.importorskip("torch", reason="torch is a test-only dependency, installed on Python 3.11 only")
    import transformers

    from paged import LLM, SamplingParams
    prompt = np.random.default_rng(0).integers(10, 600, 12).tolist()
    llm = LLM(tiny_shape, dtype="float32", show_progress=False)
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_shape, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, eos_token_id=None,
                             pad_token_id=0)
    assert got == out[0, len(prompt):].tolist()


def test_the_llama_8b_shape_has_the_published_size():
    """The engine's own parameter tree for the config: Llama-3.1-8B's published 8,030,261,248 parameters."""
    from paged.models.config import load_model_config
    from paged.models.loader import parameter_shapes
    from paged.models.registry import model_class
    directory = shapes.model_shape_config_dir("llama-3.1-8b")
    config = load_model_config(directory)
    model = model_class(config.architecture)(config, np.dtype("bfloat16"))
    assert sum(int(np.prod(shape)) for shape, _ in parameter_shapes(model).values()) == 8_030_261_248


def test_a_config_only_shape_has_no_weights_and_loads_dummy_ones(monkeypatch, tmp_path):
    import os
    from paged.models.loader import load_model
    _register_small(monkeypatch, tmp_path, "llama-3.1-8b", "tiny-llama3", head_dim=16)
    directory = shapes.model_shape_config_dir("tiny-llama3")
    assert not [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    assert shapes.model_shape_config_dir("tiny-llama3") == directory
    params = load_model(directory, show_progress=False, load_format="dummy")[3]
    assert params["embed_tokens"]["embedding"].shape == (600, 64)
    assert params["lm_head"]["kernel"].shape == (64, 600)  # not tied
