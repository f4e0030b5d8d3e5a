"""Pooling models against their references: embeddings against sentence-transformers (a decoder, BERT and
XLM-RoBERTa, each with the pooling its sentence-transformers config declares), scores against
sentence-transformers' CrossEncoder and classifiers against transformers, all on tiny random checkpoints
written by those libraries."""

from __future__ import annotations

import numpy as np
import pytest

from tests.pooling_checkpoints import build_encoder, plain_decoder, sentence_transformer, torch, transformers

from paged import LLM, PoolingParams, SamplingParams
from paged.engine import runner_type

TEXTS = ["Paged attention keeps the cache in blocks.", "a", "the quick brown fox jumps over the lazy dog " * 4,
         "Continuous batching admits new requests every step.", "key value"]
# Short and long inputs mixed, so that one step packs sequences of very different lengths.
MIXED = [TEXTS[i % len(TEXTS)] * (1 + i % 3) for i in range(13)]
OPTIONS = dict(show_progress=False, max_num_seqs=8, max_model_len=128)


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def embeddings(llm, texts, **kwargs) -> np.ndarray:
    return np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False, **kwargs)])


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """A Qwen3 decoder as Qwen3-Embedding is shipped: last-token pooling, normalised, Matryoshka."""
    root = tmp_path_factory.mktemp("pooling-decoder")
    base = plain_decoder(str(root / "qwen3"))
    reference = sentence_transformer(str(root / "st"), base, "lasttoken", True, {"is_matryoshka": True})
    return base, str(root / "st"), reference


@pytest.fixture(scope="module")
def decoder_llm(decoder):
    return LLM(decoder[1], **OPTIONS)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """BERT with mean pooling, normalised (the MiniLM / bge class)."""
    root = tmp_path_factory.mktemp("pooling-bert")
    base = build_encoder(str(root / "bert"))
    return sentence_transformer(str(root / "st"), base, "mean", True), str(root / "st")


@pytest.fixture(scope="module")
def bert_llm(bert):
    return LLM(bert[1], **OPTIONS)


def test_decoder_embeddings_equal_sentence_transformers(decoder, decoder_llm):
    _, _, reference = decoder
    assert decoder_llm.engine.runner_type == "pooling"
    assert decoder_llm.engine.pooler_config.pooling_type == "LAST"
    got = embeddings(decoder_llm, TEXTS)
    assert cosines(got, reference.encode(TEXTS)).min() > 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_bert_mean_pooling_equals_sentence_transformers(bert, bert_llm):
    reference, _ = bert
    assert bert_llm.engine.pooler_config.pooling_type == "MEAN"
    assert cosines(embeddings(bert_llm, TEXTS), reference.encode(TEXTS)).min() > 0.9999


def test_xlm_roberta_cls_pooling_equals_sentence_transformers(tmp_path):
    base = build_encoder(str(tmp_path / "xlmr"), roberta=True)
    reference = sentence_transformer(str(tmp_path / "st"), base, "cls", False)
    llm = LLM(str(tmp_path / "st"), **OPTIONS)
    assert llm.engine.pooler_config.pooling_type == "CLS" and llm.engine.pooler_config.use_activation is False
    got, want = embeddings(llm, TEXTS), reference.encode(TEXTS)
    assert cosines(got, want).min() > 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), rtol=1e-4)


def test_batched_inputs_give_the_vectors_of_one_at_a_time(decoder_llm, bert_llm):
    for llm in (decoder_llm, bert_llm):
        together = embeddings(llm, MIXED)
        alone = np.array([embeddings(llm, [text])[0] for text in MIXED])
        np.testing.assert_allclose(together, alone, atol=2e-5)


def test_a_causal_lm_pools_with_runner_pooling(decoder):
    base, _, reference = decoder
    llm = LLM(base, runner="pooling", **OPTIONS)  # vLLM's convert=embed: last token, normalised
    assert cosines(embeddings(llm, TEXTS), reference.encode(TEXTS)).min() > 0.9999
    with pytest.raises(ValueError, match="pooling model"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)


def test_matryoshka_dimensions_truncate_then_normalise(decoder, decoder_llm):
    _, _, reference = decoder
    got = embeddings(decoder_llm, TEXTS, pooling_params=PoolingParams(dimensions=16))
    want = reference.encode(TEXTS, truncate_dim=16)
    want = want / np.linalg.norm(want, axis=1, keepdims=True)
    assert got.shape == (len(TEXTS), 16)
    np.testing.assert_allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError, match=r"range \[1, 64\]"):
        decoder_llm.embed(TEXTS[:1], pooling_params=PoolingParams(dimensions=65), use_tqdm=False)


def test_dimensions_need_a_matryoshka_model(bert_llm):
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        bert_llm.embed(TEXTS[:1], pooling_params=PoolingParams(dimensions=8), use_tqdm=False)


def test_use_activation_false_returns_the_pooled_vector_unnormalised(bert, bert_llm):
    reference, _ = bert
    raw = embeddings(bert_llm, TEXTS, pooling_params=PoolingParams(use_activation=False))
    unnormalised = reference.encode(TEXTS, normalize_embeddings=False)  # without the Normalize module's effect
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True),
                               unnormalised / np.linalg.norm(unnormalised, axis=1, keepdims=True), atol=1e-5)


def test_truncate_prompt_tokens_keeps_the_last_tokens(bert_llm):
    ids = bert_llm.get_tokenizer().encode(TEXTS[2])
    cut = embeddings(bert_llm, [{"prompt_token_ids": ids}], truncate_prompt_tokens=7)
    assert np.allclose(cut, embeddings(bert_llm, [{"prompt_token_ids": ids[-7:]}]), atol=1e-6)
    with pytest.raises(ValueError, match="more than max_model_len=128"):
        bert_llm.embed([{"prompt_token_ids": ids * 20}], use_tqdm=False)


def test_encode_returns_the_pooled_vector(bert_llm):
    [output] = bert_llm.encode(TEXTS[:1], use_tqdm=False)
    assert output.finished and output.outputs.data.dtype == np.float32
    assert output.outputs.data.shape == (64,) and output.prompt_token_ids[0] == 2  # [CLS]


@pytest.mark.parametrize("roberta", [False, True], ids=["bert", "xlm-roberta"])
def test_cross_encoder_scores_equal_sentence_transformers(tmp_path, roberta):
    from sentence_transformers import CrossEncoder
    directory = build_encoder(str(tmp_path / "ce"), roberta=roberta, num_labels=1)
    query, documents = "what is paged attention", ["blocks of the key value cache", "the lazy dog", "a"]
    want = CrossEncoder(directory, device="cpu").predict([(query, doc) for doc in documents])
    llm = LLM(directory, **OPTIONS)
    assert llm.engine.pooling_task == "classify"
    got = [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]
    np.testing.assert_allclose(got, want, atol=1e-4)
    pairwise = [o.outputs.score for o in llm.score([query] * 3, documents, use_tqdm=False)]
    np.testing.assert_allclose(pairwise, got, atol=1e-6)
    with pytest.raises(ValueError, match="classifier"):
        llm.embed("hello", use_tqdm=False)


def test_classifier_probabilities_equal_transformers(tmp_path):
    directory = build_encoder(str(tmp_path / "cls"), num_labels=3)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory).eval()
    with torch.no_grad():
        logits = [model(**tokenizer(text, return_tensors="pt")).logits[0].numpy() for text in TEXTS]
    llm = LLM(directory, **OPTIONS)
    probs = [o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)]
    want = [np.exp(x - x.max()) / np.exp(x - x.max()).sum() for x in logits]
    np.testing.assert_allclose(probs, want, atol=1e-4)
    raw = [o.outputs.probs for o in llm.classify(TEXTS, pooling_params=PoolingParams(use_activation=False),
                                                  use_tqdm=False)]
    np.testing.assert_allclose(raw, logits, atol=1e-4)


def test_embedding_model_scores_are_cosine_similarities(bert, bert_llm):
    reference, _ = bert
    scores = [o.outputs.score for o in bert_llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)]
    want = reference.similarity(reference.encode(TEXTS[:1]), reference.encode(TEXTS[1:]))[0].numpy()
    np.testing.assert_allclose(scores, want, atol=1e-4)


def test_runner_resolution(decoder, tmp_path):
    base, st_dir, _ = decoder
    assert runner_type("auto", "Qwen3ForCausalLM", base) == "generate"
    assert runner_type("auto", "Qwen3ForCausalLM", st_dir) == "pooling"  # a sentence-transformers checkpoint
    assert runner_type("auto", "BertModel", str(tmp_path)) == "pooling"
    with pytest.raises(ValueError, match="has no LM head"):
        runner_type("generate", "XLMRobertaForSequenceClassification", str(tmp_path))
    generating = LLM(base, **OPTIONS)
    with pytest.raises(ValueError, match="not a pooling model"):
        generating.embed("hello", use_tqdm=False)


@pytest.mark.parametrize("num_labels", [1, 3])
def test_decoder_sequence_classifier_equals_transformers(tmp_path, num_labels):
    from tests.pooling_checkpoints import build_decoder_classifier
    directory = build_decoder_classifier(str(tmp_path / "cls"), num_labels)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory).eval()
    llm = LLM(directory, **OPTIONS)
    assert llm.engine.runner_type == "pooling" and llm.engine.pooler_config.pooling_type == "LAST"
    tokenizer = llm.get_tokenizer()
    with torch.no_grad():
        logits = [model(torch.tensor([tokenizer.encode(t)])).logits[0].double().numpy() for t in TEXTS]
    want = [1 / (1 + np.exp(-x)) if num_labels == 1 else np.exp(x - x.max()) / np.exp(x - x.max()).sum()
            for x in logits]
    np.testing.assert_allclose([o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)], want, atol=1e-4)


def test_causal_lm_reranker_through_hf_overrides(decoder):
    """Qwen3-Reranker as vLLM reads it: the LM's p(yes) against p(no) at the last token, one label."""
    base, _, _ = decoder
    model = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    no, yes = [w for w in ("the", "of", "a", "in", "and", "is") if len(tokenizer.encode(w)) == 1][:2]
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
                 "is_original_qwen3_reranker": True}
    llm = LLM(base, runner="pooling", hf_overrides=overrides, **OPTIONS)
    assert llm.engine.pooling_task == "classify"
    ids = [tokenizer.encode(no)[0], tokenizer.encode(yes)[0]]
    with torch.no_grad():
        last = [model(torch.tensor([tokenizer.encode(t)])).logits[0, -1, ids].double().numpy() for t in TEXTS]
    want = [np.exp(x[1]) / np.exp(x).sum() for x in last]
    got = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS, use_tqdm=False)]
    np.testing.assert_allclose([o.outputs.probs[0] for o in llm.classify(TEXTS, use_tqdm=False)], want, atol=1e-4)
    pairs = [tokenizer(TEXTS[0], t)["input_ids"] for t in TEXTS]
    with torch.no_grad():
        pair_last = [model(torch.tensor([p])).logits[0, -1, ids].double().numpy() for p in pairs]
    np.testing.assert_allclose(got, [np.exp(x[1]) / np.exp(x).sum() for x in pair_last], atol=1e-4)
