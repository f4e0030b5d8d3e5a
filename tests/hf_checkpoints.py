"""Tiny random Hugging Face checkpoints built with transformers + torch (test-only)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch", reason="torch is a test-only dependency, installed on Python 3.11 only")
transformers = pytest.importorskip("transformers")

from paged.models.tiny import _train_tokenizer  # noqa: E402

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, rms_norm_eps=1e-6,
              # A wide init keeps the top-2 logit gap large, so float32 summation order cannot flip a greedy pick.
              initializer_range=0.3)

# name -> (config class, extra config); chosen to cover GQA, MQA, tied embeddings, llama3 rope scaling,
# Qwen2's qkv biases and Mistral's sliding window.
SPECS = {
    "llama-gqa": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0)),
    "llama3-mqa-tied": ("LlamaConfig", dict(
        num_key_value_heads=1, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "mistral-window": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=24, head_dim=16)),
    "qwen2-tied": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-qknorm": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    "phi3-fused": ("Phi3Config", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),
    # Alternating sliding (window 12) and global layers, soft caps low enough to bite.
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, sliding_window=12,
                                    query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=3.0)),
    # Gemma 3: q/k norms, a local rotary base for sliding layers, a linearly scaled global one; no soft caps.
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=4, num_key_value_heads=2, head_dim=16, sliding_window=12, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})),
    # GLM: half of each head rotates, in interleaved pairs; fused gate_up_proj; qkv biases. GLM-4 adds
    # norms after attention and after the MLP.
    "glm": ("GlmConfig", dict(num_key_value_heads=2, head_dim=16)),
    "glm4": ("Glm4Config", dict(num_key_value_heads=2, head_dim=32)),
    # Sparse MoE: 4 experts, top 2 (Mixtral renormalises; Qwen2-MoE does not and adds a gated shared expert;
    # Qwen3-MoE renormalises here and has q/k norms).
    "mixtral-moe": ("MixtralConfig", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2-moe": ("Qwen2MoeConfig", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=48, shared_expert_intermediate_size=96,
                                         norm_topk_prob=False)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=48, norm_topk_prob=True)),
}


def build_checkpoint(name: str, directory: str, dtype=None, overrides: dict | None = None) -> str:
    """Writes a seeded random checkpoint + tokenizer; returns the directory. `overrides`: config fields set
    last (e.g. more attention heads)."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    config_name, extra = SPECS[name]
    vocab = _train_tokenizer(directory, 512)
    common = {} if config_name == "GPT2Config" else COMMON
    config = getattr(transformers, config_name)(vocab_size=vocab, bos_token_id=0, eos_token_id=1,
                                                pad_token_id=0, **{**common, **extra, **(overrides or {})})
    if config_name == "GPT2Config":
        config.initializer_range = COMMON["initializer_range"]
        model_class = transformers.GPT2LMHeadModel
    else:
        model_class = getattr(transformers, config_name.replace("TextConfig", "Config").replace("Config", "ForCausalLM"))
    torch.manual_seed(0)
    model = model_class(config).eval()
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(directory)
    return directory


def hf_model(directory: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(directory: str, prompts: list[list[int]], max_new_tokens: int, **generate_kwargs) -> list[list[int]]:
    """Greedy continuation of each prompt by transformers, in float32, never stopping early."""
    return model_greedy(hf_model(directory), prompts, max_new_tokens, **generate_kwargs)


def model_greedy(model, prompts: list[list[int]], max_new_tokens: int, **generate_kwargs) -> list[list[int]]:
    """Greedy continuation of each prompt by a transformers model already built (one prompt at a time)."""
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0, **generate_kwargs)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def hf_log_softmax(directory: str, token_ids: list[int]):
    """float64 log-probabilities [len, vocab] of the next token at every position."""
    with torch.no_grad():
        logits = hf_model(directory)(torch.tensor([token_ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()
