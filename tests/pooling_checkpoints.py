"""Tiny random embedding and reranking checkpoints, written by transformers and sentence-transformers
themselves (test-only): a decoder (Qwen3) and two encoders (BERT, XLM-RoBERTa) saved as sentence-transformers
models with their pooling configs, and cross-encoders (sequence classifiers)."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch", reason="torch is a test-only dependency, installed on Python 3.11 only")
transformers = pytest.importorskip("transformers")
sentence_transformers = pytest.importorskip("sentence_transformers")

from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer  # noqa: E402

from paged.models.tiny import train_encoder_tokenizer  # noqa: E402
from tests.hf_checkpoints import build_checkpoint  # noqa: E402

ENCODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=128, initializer_range=0.3, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)


def build_encoder(directory: str, roberta: bool = False, num_labels: int = 0) -> str:
    """A random BertModel / XLMRobertaModel (or, with num_labels, its ForSequenceClassification) and its
    tokenizer, saved by transformers."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    tokenizer = train_encoder_tokenizer(directory, roberta)
    if roberta:
        config = transformers.XLMRobertaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                               bos_token_id=0, eos_token_id=2, type_vocab_size=1,
                                               **{**ENCODER, "max_position_embeddings": 130})
        cls = transformers.XLMRobertaForSequenceClassification if num_labels else transformers.XLMRobertaModel
    else:
        config = transformers.BertConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                         type_vocab_size=2, **ENCODER)
        cls = transformers.BertForSequenceClassification if num_labels else transformers.BertModel
    if num_labels:
        config.num_labels = num_labels
    torch.manual_seed(0)
    model = cls(config).eval()
    model.save_pretrained(directory)
    return directory


def sentence_transformer(directory: str, base: str, pooling_mode: str, normalize: bool, config: dict | None = None):
    """`base` (a transformers checkpoint) wrapped as a sentence-transformers model with the given Pooling (and a
    Normalize module), saved to `directory` by sentence-transformers; `config`: fields added to config.json.
    Returns the loaded SentenceTransformer (the reference)."""
    if not os.path.exists(os.path.join(directory, "modules.json")):
        transformer = Transformer(base)
        if transformer.tokenizer.pad_token is None:
            transformer.tokenizer.pad_token = transformer.tokenizer.decode([0])
        modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling_mode)]
        model = sentence_transformers.SentenceTransformer(modules=modules + [Normalize()] * normalize, device="cpu")
        model.save(directory)
        if config:
            path = os.path.join(directory, "config.json")
            with open(path) as f:
                saved = json.load(f)
            with open(path, "w") as f:
                json.dump({**saved, **config}, f, indent=2)
    return sentence_transformers.SentenceTransformer(directory, device="cpu")


def plain_decoder(directory: str) -> str:
    """The tiny Qwen3 checkpoint without its chat template: sentence-transformers would otherwise read plain
    texts as chat messages, and both sides must tokenize a text the same way."""
    build_checkpoint("qwen3-qknorm", directory)
    template = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(template):
        os.remove(template)
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config.pop("chat_template", None)
    with open(path, "w") as f:
        json.dump(config, f)
    return directory


def build_decoder_classifier(directory: str, num_labels: int) -> str:
    """A random Qwen3ForSequenceClassification (a score head over the last token) and its tokenizer."""
    from tests.hf_checkpoints import COMMON
    from paged.models.tiny import _train_tokenizer
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    vocab = _train_tokenizer(directory, 512)
    config = transformers.Qwen3Config(vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=0,
                                      num_key_value_heads=2, head_dim=32, num_labels=num_labels, **COMMON)
    torch.manual_seed(0)
    transformers.Qwen3ForSequenceClassification(config).eval().save_pretrained(directory)
    return directory
