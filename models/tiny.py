"""Builds a tiny random-weight Llama checkpoint in Hugging Face format, offline and without torch.

The tests' model (`LLM("paged-tiny-llama")` builds it under the cache root): it exercises the whole stack
(tokenizer, safetensors loading, paged cache, scheduler, sampler) in milliseconds a step. Its text is noise;
the built-in model that writes text is the demo model (models/demo_model/).
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

from paged.kernels.cache import cache_root

TINY_MODEL_NAME = "paged-tiny-llama"

_CORPUS = """Paged attention keeps the key-value cache in fixed-size blocks, like pages of virtual memory.
Each sequence owns a page table; blocks are allocated on demand and freed when the request finishes.
Continuous batching lets requests join and leave the running batch at every step.
The quick brown fox jumps over the lazy dog. Hello world! How are you today?
JAX compiles the step function once per shape bucket; the cache is donated and updated in place.
"""

_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _train_tokenizer(directory: str, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_CORPUS.splitlines() * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return tokenizer.get_vocab_size()


def train_encoder_tokenizer(directory: str, roberta: bool = False):
    """A WordPiece tokenizer trained on the tiny corpus with BERT's special tokens and pair template
    ([CLS] a [SEP] b [SEP], token types 0 then 1), or XLM-RoBERTa's (<s> a </s></s> b </s>, <pad> = 1, no
    token types); saved to `directory` and returned (a transformers PreTrainedTokenizerFast)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"] if roberta else ["[PAD]", "[UNK]", "[CLS]", "[SEP]",
                                                                         "[MASK]"]
    cls, pad, sep, unk, mask = (specials if roberta else
                                [specials[2], specials[0], specials[3], specials[1], specials[4]])
    tokenizer = Tokenizer(models.WordPiece(unk_token=unk))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(_CORPUS.splitlines() * 4, trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False))
    special_ids = [(cls, tokenizer.token_to_id(cls)), (sep, tokenizer.token_to_id(sep))]
    pair = f"{cls} $A {sep} {sep} $B {sep}" if roberta else f"{cls} $A {sep} $B:1 {sep}:1"
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{cls} $A {sep}", pair=pair,
                                                             special_tokens=special_ids)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, cls_token=cls, sep_token=sep, pad_token=pad, unk_token=unk, mask_token=mask,
        model_input_names=["input_ids", "attention_mask"] if roberta else
        ["input_ids", "token_type_ids", "attention_mask"])
    fast.save_pretrained(directory)
    return fast


def create_tiny_llama(directory: str, *, vocab_size: int = 512, hidden_size: int = 64,
                      intermediate_size: int = 128, num_layers: int = 2, num_heads: int = 4,
                      num_kv_heads: int = 2, seed: int = 0, model_vocab_size: int | None = None,
                      max_position_embeddings: int = 1024, tie_word_embeddings: bool = False) -> str:
    """Writes config.json, model.safetensors and a trained byte-level BPE tokenizer into `directory`.

    The tokenizer's vocabulary is at most `vocab_size` (the corpus is small); `model_vocab_size` sets a larger
    embedding table when a benchmark needs realistic LM-head costs (the extra ids have no text);
    `tie_word_embeddings` leaves out lm_head.weight (the LM head is the embedding table).
    """
    os.makedirs(directory, exist_ok=True)
    real_vocab = max(_train_tokenizer(directory, vocab_size), model_vocab_size or 0)
    head_dim = hidden_size // num_heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": real_vocab,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": tie_word_embeddings, "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1,
        "torch_dtype": "float32", "paged_random_weights": True,  # models/builtin.py reads it
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    rng = np.random.default_rng(seed)
    normal = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)  # HF layout [out, in]
    tensors = {"model.embed_tokens.weight": normal(real_vocab, hidden_size),
               "model.norm.weight": np.ones(hidden_size, np.float32)}
    if not tie_word_embeddings:
        tensors["lm_head.weight"] = normal(real_vocab, hidden_size)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": np.ones(hidden_size, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden_size, np.float32),
            p + "self_attn.q_proj.weight": normal(num_heads * head_dim, hidden_size),
            p + "self_attn.k_proj.weight": normal(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.v_proj.weight": normal(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.o_proj.weight": normal(hidden_size, num_heads * head_dim),
            p + "mlp.gate_proj.weight": normal(intermediate_size, hidden_size),
            p + "mlp.up_proj.weight": normal(intermediate_size, hidden_size),
            p + "mlp.down_proj.weight": normal(hidden_size, intermediate_size),
        })
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return directory


def default_tiny_model_dir() -> str:
    """The tiny model under the cache root (`$PAGED_CACHE_DIR`, pallas_kernels/cache.py), created on first use."""
    directory = str(cache_root() / TINY_MODEL_NAME)
    if not os.path.exists(os.path.join(directory, "model.safetensors")):
        create_tiny_llama(directory)
    return directory
