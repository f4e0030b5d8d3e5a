"""Checkpoints written by Google's `gemma` library (models/gemma_checkpoint.py) against that library's own forward
pass. The fixtures in tests/fixtures/gemma_library were written by gemma 3.3.0 itself
(`make_checkpoints.py` beside them: a tiny random Gemma 3, saved with `gm.ckpts.save_params`, and the logits of
`gm.nn.Transformer` on two sequences): float32 with grouped KV heads in the library's nested layout and in the
released checkpoints' flat layout, bfloat16, and equal KV and query heads (a fused qkv_einsum)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from paged import LLM, SamplingParams
from paged.models.gemma_checkpoint import hf_config, is_gemma_checkpoint

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "gemma_library")


def _overrides(variant: str) -> dict:
    """What the tiny model sets apart from the released sizes, from the library config it was built with."""
    with open(os.path.join(FIXTURES, f"tiny_{variant}", "library_config.json")) as f:
        library = json.load(f)["transformer_config"]
    layer_types = ["sliding_attention" if t == "LOCAL_SLIDING" else "full_attention"
                   for t in library["attention_types"]]
    return {"sliding_window": library["sliding_window_size"], "layer_types": layer_types,
            "rope_scaling": {"rope_type": "linear", "factor": library["global_scale_factor"]},
            "rope_theta": float(library["global_base_frequency"]),
            "rope_local_base_freq": float(library["local_base_frequency"])}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("variant, layout, dtype, tolerance", [
    ("f32", "ckpt", "float32", 2e-4), ("f32", "ckpt_flat", "float32", 2e-4), ("mha", "ckpt", "float32", 2e-4),
    ("bf16", "ckpt", "bfloat16", 0.15)], ids=["nested", "flat", "fused-qkv", "bfloat16"])
def test_prompt_logprobs_match_the_librarys_forward_pass(tiny_model_dir, variant, layout, dtype, tolerance):
    path = os.path.join(FIXTURES, f"tiny_{variant}", layout)
    reference = np.load(os.path.join(FIXTURES, f"tiny_{variant}", "reference.npz"))
    assert is_gemma_checkpoint(path)
    # The library saves no tokenizer: any tokenizer serves token-id prompts (the tiny model's here).
    llm = LLM(path, tokenizer=tiny_model_dir, dtype=dtype, max_model_len=64, show_progress=False,
              hf_overrides=_overrides(variant))
    assert llm.engine.model_config.architecture == "Gemma3ForCausalLM"
    prompts = [{"prompt_token_ids": row.tolist()} for row in reference["tokens"]]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    for output, tokens, logits in zip(llm.generate(prompts, params, use_tqdm=False), reference["tokens"],
                                      reference["logits"]):
        want = _log_softmax(logits)
        got = [entry[int(token)].logprob for entry, token in zip(output.prompt_logprobs[1:], tokens[1:])]
        expected = [want[i, int(token)] for i, token in enumerate(tokens[1:])]
        np.testing.assert_allclose(got, expected, atol=tolerance)
        if dtype == "float32":  # bfloat16 near-ties may order otherwise
            assert output.outputs[0].token_ids[0] == int(np.argmax(logits[-1]))


@pytest.mark.parametrize("name", ["Gemma3_270M", "Gemma3_1B", "Gemma3_4B", "Gemma3_12B", "Gemma3_27B", "Gemma2_2B",
                                  "Gemma2_9B", "Gemma2_27B"])
def test_released_sizes_read_as_the_library_defines_them(name, monkeypatch):
    """A tree of each released size's shapes (no weights) gives the model the library's definition of that size
    describes (released_configs.json: the library's own config objects, dumped by make_checkpoints.py): its
    windows layer by layer, query scaling, soft caps and rope bases and scaling."""
    from paged.models import gemma_checkpoint
    from paged.models.config import model_config_from_hf
    with open(os.path.join(FIXTURES, "released_configs.json")) as f:
        library = json.load(f)[name]
    width, heads, kv_heads, head_dim = library["embed_dim"], library["num_heads"], library["num_kv_heads"], \
        library["head_dim"]
    gating = (2, library["hidden_dim"], width) if library["transpose_gating_einsum"] else (2, width, library["hidden_dim"])
    tree = {"embedder/input_embedding": (library["num_embed"], width)}
    for i in range(library["num_layers"]):
        tree.update({f"layer_{i}/attn/q_einsum/w": (heads, width, head_dim),
                     f"layer_{i}/attn/kv_einsum/w": (2, kv_heads, width, head_dim),
                     f"layer_{i}/mlp/gating_einsum": gating})
        if library["use_qk_norm"]:
            tree[f"layer_{i}/attn/_query_norm/scale"] = (head_dim,)
    monkeypatch.setattr(gemma_checkpoint, "_shapes", lambda _: tree)
    raw = hf_config("unused")
    config = model_config_from_hf(raw)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers, config.num_heads,
            config.num_kv_heads, config.head_dim) == (library["num_embed"], width, library["hidden_dim"],
                                                      library["num_layers"], heads, kv_heads, head_dim)
    window = library["sliding_window_size"]
    assert list(config.layer_windows) == [window if t == "LOCAL_SLIDING" else 0
                                          for t in library["attention_types"][:library["num_layers"]]]
    assert config.query_pre_attn_scalar ** -0.5 == pytest.approx(library["query_pre_attn_scalar"])
    assert config.final_soft_cap == library["final_logit_softcap"]
    assert config.attn_soft_cap == library["attn_logits_soft_cap"]
    assert config.rope.theta == library["global_base_frequency"]
    assert (config.rope.factor or 1.0) == library["global_scale_factor"]
    if config.local_rope is not None:
        assert config.local_rope.theta == library["local_base_frequency"]
    else:
        assert library["local_base_frequency"] == library["global_base_frequency"]


def test_a_plain_orbax_directory_is_not_taken_for_one(tmp_path):
    (tmp_path / "_CHECKPOINT_METADATA").write_text("{}")
    (tmp_path / "config.json").write_text("{}")
    assert not is_gemma_checkpoint(str(tmp_path))
