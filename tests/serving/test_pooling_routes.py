"""The pooling routes through `paged serve`: the official openai client's embeddings.create (float and base64,
dimensions) against sentence-transformers, /pooling, /classify, /score and /rerank in vLLM's shapes against
CrossEncoder, and the 400s that send a request to the routes its model serves."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from tests.pooling_checkpoints import build_encoder, sentence_transformer
from tests.serving.server_fixture import Server

openai = pytest.importorskip("openai")

TEXTS = ["Paged attention keeps the cache in blocks.", "a", "the quick brown fox jumps over the lazy dog " * 3]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """BERT, mean pooling, normalised, allowed Matryoshka truncation; served."""
    root = tmp_path_factory.mktemp("serve-embed")
    base = build_encoder(str(root / "bert"))
    reference = sentence_transformer(str(root / "st"), base, "mean", True, {"is_matryoshka": True})
    server = Server(str(root / "st"), "--max-model-len", "128", "--max-num-seqs", "8")
    yield server, reference
    server.stop()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """A BERT cross-encoder (one label); served."""
    from sentence_transformers import CrossEncoder
    directory = build_encoder(str(tmp_path_factory.mktemp("serve-rerank") / "ce"), num_labels=1)
    server = Server(directory, "--max-model-len", "128", "--max-num-seqs", "8")
    yield server, CrossEncoder(directory, device="cpu")
    server.stop()


def test_openai_client_embeddings_float_and_base64(embedder):
    server, reference = embedder
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    want = reference.encode(TEXTS)
    for encoding in ("float", "base64"):  # asked for by name, base64 comes back as the string it is
        reply = client.embeddings.create(model="tiny", input=TEXTS, encoding_format=encoding)
        got = [item.embedding for item in reply.data]
        if encoding == "base64":
            got = [np.frombuffer(base64.b64decode(text), "<f4") for text in got]
        np.testing.assert_allclose(np.array(got), want, atol=1e-5)
        assert [item.index for item in reply.data] == [0, 1, 2]
        assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(TEXTS)
    # Named by nobody, the client asks for base64 and decodes it itself.
    default = client.embeddings.create(model="tiny", input=TEXTS[0])
    np.testing.assert_allclose(default.data[0].embedding, want[0], atol=1e-5)


def test_dimensions_and_token_ids(embedder):
    server, reference = embedder
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    reply = client.embeddings.create(model="tiny", input=TEXTS, dimensions=16)
    want = reference.encode(TEXTS, truncate_dim=16)
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    np.testing.assert_allclose([item.embedding for item in reply.data], want, atol=1e-5)
    ids = reference.tokenizer(TEXTS[0])["input_ids"]
    by_ids = client.embeddings.create(model="tiny", input=[ids, ids[:4]])
    np.testing.assert_allclose(by_ids.data[0].embedding, reference.encode(TEXTS[:1])[0], atol=1e-5)
    too_many = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS[0], "dimensions": 65})
    assert too_many.status_code == 400 and "range [1, 64]" in too_many.json()["error"]["message"]


def test_pooling_route_and_models_listing(embedder):
    server, reference = embedder
    reply = httpx.post(server.url + "/pooling", json={"model": "tiny", "input": TEXTS[:2]}).json()
    assert reply["object"] == "list" and [d["object"] for d in reply["data"]] == ["pooling", "pooling"]
    np.testing.assert_allclose([d["data"] for d in reply["data"]], reference.encode(TEXTS[:2]), atol=1e-5)
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["task"] == "embed"


def test_embedding_model_scores_and_reranks_by_cosine(embedder):
    server, reference = embedder
    reply = httpx.post(server.url + "/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    want = reference.similarity(reference.encode(TEXTS[:1]), reference.encode(TEXTS[1:]))[0].numpy()
    np.testing.assert_allclose([d["score"] for d in reply["data"]], want, atol=1e-4)


def test_generation_routes_on_a_pooling_model_are_400s_naming_the_routes(embedder):
    server, _ = embedder
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/responses", {"input": "hi"})):
        reply = httpx.post(server.url + path, json={"model": "tiny", **body})
        assert reply.status_code == 400, path
        assert "/v1/embeddings" in reply.json()["error"]["message"]
    reply = httpx.post(server.url + "/classify", json={"input": "hi"})
    assert reply.status_code == 400 and "/v1/embeddings" in reply.json()["error"]["message"]


def test_score_and_rerank_equal_cross_encoder(reranker):
    server, cross_encoder = reranker
    query, documents = "what is paged attention", ["blocks of the key value cache", "the lazy dog", "a b"]
    want = cross_encoder.predict([(query, d) for d in documents])
    for body in ({"queries": query, "documents": documents}, {"text_1": query, "text_2": documents}):
        reply = httpx.post(server.url + "/score", json={"model": "tiny", **body}).json()
        assert [d["object"] for d in reply["data"]] == ["score"] * 3 and reply["usage"]["prompt_tokens"] > 0
        np.testing.assert_allclose([d["score"] for d in reply["data"]], want, atol=1e-4)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        reply = httpx.post(server.url + path, json={"model": "tiny", "query": query, "documents": documents,
                                                    "top_n": 2}).json()
        order = list(np.argsort(-want)[:2])
        assert [r["index"] for r in reply["results"]] == order
        np.testing.assert_allclose([r["relevance_score"] for r in reply["results"]], want[order], atol=1e-4)
        assert reply["results"][0]["document"] == {"text": documents[order[0]]}
    bare = httpx.post(server.url + "/rerank", json={"query": query, "documents": documents,
                                                    "return_documents": False}).json()
    assert len(bare["results"]) == 3 and "document" not in bare["results"][0]


def test_classify_and_wrong_routes_on_a_cross_encoder(reranker):
    server, cross_encoder = reranker
    reply = httpx.post(server.url + "/classify", json={"input": ["hello world", "a"]}).json()
    assert [d["num_classes"] for d in reply["data"]] == [1, 1] and reply["data"][0]["label"] == "LABEL_0"
    embeddings = httpx.post(server.url + "/v1/embeddings", json={"input": "hello"})
    assert embeddings.status_code == 400 and "/classify" in embeddings.json()["error"]["message"]
    missing = httpx.post(server.url + "/score", json={"queries": "q"})
    assert missing.status_code == 400
    metrics = httpx.get(server.url + "/metrics").text
    assert 'paged:pooling_requests_total{engine="0",model_name="tiny",task="classify"} 2.0' in metrics


def test_pooling_routes_on_a_generating_model_are_400s_naming_the_routes():
    import asyncio

    from paged.serving.errors import APIError
    from paged.serving.pooling import embeddings, rerank
    from paged.serving.pooling_protocol import EmbeddingRequest, RerankRequest
    from paged.serving.state import ServerState

    class Generating:  # what the handlers read of a generating model's engine
        runner_type, pooling_task, tokenizer = "generate", None, None

    state = ServerState(Generating(), "tiny")
    for handler, body in ((embeddings, EmbeddingRequest(input="hi")),
                          (rerank, RerankRequest(query="q", documents=["d"]))):
        with pytest.raises(APIError) as caught:
            asyncio.run(handler(body, None, state))
        assert caught.value.status == 400 and "/v1/chat/completions" in caught.value.message


def test_chat_style_embedding_input_is_rendered_by_the_chat_template(tmp_path):
    import asyncio

    import transformers

    from paged.serving.pooling import _embedding_inputs
    from paged.serving.pooling_protocol import EmbeddingRequest
    from paged.serving.state import ServerState
    from tests.hf_checkpoints import build_checkpoint

    tokenizer = transformers.AutoTokenizer.from_pretrained(build_checkpoint("qwen2-tied", str(tmp_path / "q")))

    class Engine:
        runner_type, pooling_task = "pooling", "embed"

        class config:
            max_model_len = 256

    Engine.tokenizer = tokenizer
    messages = [{"role": "user", "content": "paged attention"}]
    [(_, ids)] = asyncio.run(_embedding_inputs(ServerState(Engine(), "tiny"), EmbeddingRequest(messages=messages)))
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False,
                                                return_dict=False)
    with pytest.raises(ValueError, match="either input or messages"):
        EmbeddingRequest(input="x", messages=messages)
