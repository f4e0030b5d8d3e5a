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

from paged.models.tiny import _CORPUS  # noqa: E402
from tests.hf_checkpoints import build_checkpoint  # noqa: E402

ENCODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=128, initializer_range=0.3, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)


def encoder_tokenizer(directory: str, roberta: bool):
    """A WordPiece tokenizer trained on the tiny corpus, with BERT's ([CLS] a [SEP] b [SEP], token types) or
    XLM-RoBERTa's (<s> a </s></s> b </s>, <pad> = 1) special tokens and pair template."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"] if roberta else ["[PAD]", "[UNK]", "[CLS]", "[SEP]",
                                                                         "[MASK]"]
    cls, pad, sep, unk, mask = ((specials[0], specials[1], specials[2], specials[3], specials[4]) if roberta
                                else (specials[2], specials[0], specials[3], specials[1], specials[4]))
    tokenizer = Tokenizer(models.WordPiece(unk_token=unk))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(_CORPUS.splitlines() * 4, trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False))
    ids = {token: tokenizer.token_to_id(token) for token in specials}
    if roberta:
        template = processors.TemplateProcessing(single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} {sep} $B {sep}",
                                                 special_tokens=[(cls, ids[cls]), (sep, ids[sep])])
    else:
        template = processors.TemplateProcessing(single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
                                                 special_tokens=[(cls, ids[cls]), (sep, ids[sep])])
    tokenizer.post_processor = template
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, cls_token=cls, sep_token=sep, pad_token=pad, unk_token=unk, mask_token=mask,
        model_input_names=["input_ids", "attention_mask"] if roberta else
        ["input_ids", "token_type_ids", "attention_mask"])
    fast.save_pretrained(directory)
    return fast


def build_encoder(directory: str, roberta: bool = False, num_labels: int = 0) -> str:
    """A random BertModel / XLMRobertaModel (or, with num_labels, its ForSequenceClassification) and its
    tokenizer, saved by transformers."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    tokenizer = encoder_tokenizer(directory, roberta)
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
