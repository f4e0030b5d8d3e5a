"""A tiny Llama whose greedy output is a fixed script: a stand-in for a model that writes what a test needs
(a reasoning model's `<think>...</think>` and answer), run by the real engine and server.

Every layer's weights are zero, so the residual stream is the token's embedding and the next token depends
on the current one only. The embedding gives each script token a dimension of its own, and the LM head maps
that dimension to the next script token: after the chat template's last token comes the script's first,
after its last the end-of-sequence token. So the script's tokens must be distinct (checked).
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

from paged.models.tiny import create_tiny_llama


def create_scripted_llama(directory: str, script: str, added_tokens: tuple[str, ...] = ("<think>", "</think>"),
                          hidden_size: int = 64) -> str:
    """A model directory whose greedy chat reply to any conversation is `script` (then EOS)."""
    from transformers import AutoTokenizer
    create_tiny_llama(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens(list(added_tokens))  # as Qwen3's: tokens of their own, kept in the text
    tokenizer.save_pretrained(directory)
    ids = tokenizer.encode(script, add_special_tokens=False)
    if len(set(ids)) != len(ids) or len(ids) > hidden_size - 2:
        raise ValueError(f"the script's tokens must be distinct and fewer than {hidden_size - 1}: "
                         f"{tokenizer.convert_ids_to_tokens(ids)}")
    prompt_end = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"][-1]
    if prompt_end in ids:
        raise ValueError("the script may not hold the chat template's last token")
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    vocab, eos = len(tokenizer), config["eos_token_id"]
    config.update(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=hidden_size,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    start_dim, other_dim = hidden_size - 1, hidden_size - 2
    embed = np.zeros((vocab, hidden_size), np.float32)
    embed[:, other_dim] = 1.0  # any other token is followed by EOS
    embed[prompt_end] = np.eye(hidden_size, dtype=np.float32)[start_dim]
    head = np.zeros((vocab, hidden_size), np.float32)
    head[eos, other_dim] = 10.0
    head[ids[0], start_dim] = 10.0
    for position, token in enumerate(ids):
        embed[token] = np.eye(hidden_size, dtype=np.float32)[position]
        head[ids[position + 1] if position + 1 < len(ids) else eos, position] = 10.0
    zeros = lambda *shape: np.zeros(shape, np.float32)
    h, q, kv = hidden_size, hidden_size, hidden_size // 2
    tensors = {"model.embed_tokens.weight": embed, "model.norm.weight": np.ones(h, np.float32),
               "lm_head.weight": head,
               "model.layers.0.input_layernorm.weight": np.ones(h, np.float32),
               "model.layers.0.post_attention_layernorm.weight": np.ones(h, np.float32),
               "model.layers.0.self_attn.q_proj.weight": zeros(q, h),
               "model.layers.0.self_attn.k_proj.weight": zeros(kv, h),
               "model.layers.0.self_attn.v_proj.weight": zeros(kv, h),
               "model.layers.0.self_attn.o_proj.weight": zeros(h, q),
               "model.layers.0.mlp.gate_proj.weight": zeros(h, h),
               "model.layers.0.mlp.up_proj.weight": zeros(h, h),
               "model.layers.0.mlp.down_proj.weight": zeros(h, h)}
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return directory
