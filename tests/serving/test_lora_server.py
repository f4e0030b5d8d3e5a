"""LoRA adapters through `paged serve` and the official openai client: adapters named as the model, listed
with their base as parent, loaded and unloaded while requests run, each output PEFT's."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.serving.server_fixture import Server

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.torch

PROMPTS = [[5, 17, 230, 41, 9], [300, 12, 7, 7, 88, 150, 2, 61]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The base, three PEFT adapters, and the expected text of every (adapter, prompt)."""
    from transformers import AutoTokenizer

    from tests.hf_checkpoints import build_checkpoint
    from tests.paged.test_lora_engine import ADAPTERS, peft_greedy, write_adapter
    directory = tmp_path_factory.mktemp("lora-server")
    base = build_checkpoint("llama-gqa", str(directory / "base"))
    paths = [write_adapter(base, str(directory / f"adapter{i}"), targets, rank, seed=i + 1)
             for i, (targets, rank) in enumerate(ADAPTERS["llama-gqa"])]
    tokenizer = AutoTokenizer.from_pretrained(base)
    text = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    want = {(path, i): text(peft_greedy(base, path, prompt))
            for path in [None, *paths] for i, prompt in enumerate(PROMPTS)}
    return base, paths, want


@pytest.fixture(scope="module")
def server(setup):
    base, paths, _ = setup
    # Every step shape compiled before it serves (no --enforce-eager): whatever compiles later is counted.
    server = Server(base, "--dtype", "float32", "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2",
                    "--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--max-model-len", "128",
                    "--lora-modules", f"a0={paths[0]}", json.dumps({"name": "a1", "path": paths[1],
                                                                     "base_model_name": "tiny"}),
                    env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}, eager=False)
    yield server
    server.stop()


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


async def _complete(client, model: str, prompt: list[int]) -> str:
    reply = await client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert reply.model == model
    return reply.choices[0].text


def test_adapters_are_models_listed_with_their_base(setup, server):
    _, paths, _ = setup
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    cards = {card.id: card for card in client.models.list().data}
    assert list(cards)[:1] == ["tiny"] and set(cards) == {"tiny", "a0", "a1"}
    assert (cards["a0"].root, cards["a0"].parent) == (paths[0], "tiny")
    assert client.models.retrieve("a1").root == paths[1]
    with pytest.raises(openai.NotFoundError):
        asyncio.run(_complete(_client(server), "a9", PROMPTS[0]))


def test_requests_mixing_adapters_get_each_adapters_output(setup, server):
    _, paths, want = setup

    async def run():
        client = _client(server)
        jobs = [(model, path, i) for model, path in (("tiny", None), ("a0", paths[0]), ("a1", paths[1]))
                for i in range(len(PROMPTS))]
        texts = await asyncio.gather(*(_complete(client, model, PROMPTS[i]) for model, _, i in jobs))
        return [(text, want[(path, i)]) for text, (_, path, i) in zip(texts, jobs)]

    for got, expected in asyncio.run(run()):
        assert got == expected


def test_loading_and_unloading_while_requests_run(setup, server):
    """A third adapter loaded while a0 and a1 requests stream (two slots for three adapters), then unloaded;
    nothing recompiles a step shape it had compiled, and every output is its adapter's."""
    _, paths, want = setup
    url = server.url
    compiled = _compilations(server)
    assert compiled > 0  # the precompiled shapes

    async def run():
        client = _client(server)
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            running = [asyncio.create_task(_complete(client, model, PROMPTS[1])) for model in ("a0", "a1", "tiny")]
            loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": paths[2]})
            assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'a2' added successfully."
            again = await http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": paths[2]})
            assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
            results = await asyncio.gather(*running, _complete(client, "a2", PROMPTS[0]),
                                           _complete(client, "a0", PROMPTS[0]))
            removed = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
            assert removed.status_code == 200 and removed.text == "Success: LoRA adapter 'a2' removed successfully."
            gone = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
            assert gone.status_code == 404
            with pytest.raises(openai.NotFoundError):
                await _complete(client, "a2", PROMPTS[0])
            missing = await http.post("/v1/load_lora_adapter", json={"lora_name": "a3"})
            assert missing.status_code == 400
            return results

    results = asyncio.run(run())
    assert _compilations(server) == compiled
    assert results == [want[(paths[0], 1)], want[(paths[1], 1)], want[(None, 1)], want[(paths[2], 0)],
                       want[(paths[0], 0)]]


def _compilations(server) -> float:
    body = httpx.get(server.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith("paged:step_compilations_total{"))


def test_the_lora_gauge_names_running_adapters(server):
    body = httpx.get(server.url + "/metrics").text
    lines = [line for line in body.splitlines() if line.startswith("paged:lora_requests_info{")]
    assert len(lines) == 1 and 'max_lora="2"' in lines[0]


def test_lora_modules_flags_parse_as_vllm_spells_them():
    from paged.serving.cli import parse_lora_modules
    plain, spec = parse_lora_modules(["sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}'])
    assert (plain.lora_name, plain.lora_path, plain.base_model_name) == ("sql", "/a/sql", None)
    assert (spec.lora_name, spec.lora_path, spec.base_model_name) == ("chat", "/a/chat", "m")
    assert plain.lora_int_id != spec.lora_int_id
    for bad, message in (("sql", "expected name=path"), ('{"name": "x"}', "not JSON with a name and a path"),
                         ("a=/x a=/y", "given twice")):
        with pytest.raises(ValueError, match=message):
            parse_lora_modules(bad.split(" "))
