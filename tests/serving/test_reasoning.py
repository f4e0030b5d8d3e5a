"""Reasoning parsers behind the server: chat's reasoning_content, streamed or not, through a scripted engine
and through `paged serve` on a model that thinks (the parsers' own cases: tests/paged/test_reasoning.py)."""

from __future__ import annotations

import pytest

from paged.reasoning import REASONING_PARSERS


class _ScriptedStream:
    """A request's cumulative outputs: the script's pieces one at a time, then finished."""

    def __init__(self, request_id, ids, pieces):
        self.request_id, self.ids, self.pieces = request_id, ids, pieces
        self.finished, self.on_done, self._sent = False, None, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        from paged.outputs import CompletionOutput, RequestOutput
        if self._sent == len(self.pieces):
            raise StopAsyncIteration
        self._sent += 1
        done = self._sent == len(self.pieces)
        text = "".join(self.pieces[:self._sent])
        self.finished = done
        return RequestOutput(self.request_id, None, self.ids,
                             [CompletionOutput(0, text, list(range(3, 3 + self._sent)), "stop" if done else None)],
                             done)

    def close(self):
        pass


class _ScriptedEngine:
    """What the chat route reads of an engine, answering every request with the same pieces of text (a
    reasoning model's reply without the model)."""

    started, alive, grammars = True, True, None
    runner_type, pooling_task = "generate", None

    def __init__(self, tokenizer, pieces):
        self.tokenizer, self.pieces = tokenizer, pieces
        self.config = type("Config", (), {"max_model_len": 512, "max_num_seqs": 4})()
        self.model_config = type("ModelConfig", (), {"vocab_size": len(tokenizer)})()

    async def submit(self, request_id, prompt, ids, params, cache_salt=None, tenant=None, token_type_ids=None,
                     lora_request=None):
        return _ScriptedStream(request_id, ids, self.pieces)

    def start(self):
        pass

    def stop(self):
        pass


PIECES = ["<th", "ink>Let me", " think.</th", "ink>\n\nThe answer", " is 4."]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_chat_replies_carry_the_thinking_apart_streamed_or_not(tiny_model_dir, name):
    import asyncio
    import json

    import httpx
    from transformers import AutoTokenizer

    from paged.serving.app import build_app

    engine = _ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir), PIECES)
    app = build_app(engine, "tiny", reasoning_parser=name)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 50}

    async def ask(stream: bool):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
            return await client.post("/v1/chat/completions", json={**body, "stream": stream})

    whole = asyncio.run(ask(False))
    assert whole.status_code == 200, whole.text
    message = whole.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Let me think." and message["content"] == "\n\nThe answer is 4."
    streamed = asyncio.run(ask(True))
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in streamed.text.splitlines()
              if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me think."
    assert "".join(d.get("content", "") for d in deltas) == "\n\nThe answer is 4."
    assert not any("<th" in d.get("content", "") + d.get("reasoning_content", "") for d in deltas)


def test_without_a_parser_the_thinking_stays_in_the_content(tiny_model_dir):
    import asyncio

    import httpx
    from transformers import AutoTokenizer

    from paged.serving.app import build_app

    app = build_app(_ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir), PIECES), "tiny")

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
            return await client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 50})

    message = asyncio.run(ask()).json()["choices"][0]["message"]
    assert message["content"] == "".join(PIECES) and "reasoning_content" not in message


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    """A model whose greedy reply is `<think>Let</think>The answer is 4` (tests/serving/scripted_model.py)."""
    from tests.serving.scripted_model import create_scripted_llama
    return create_scripted_llama(str(tmp_path_factory.mktemp("thinking")), "<think>Let</think>The answer is 4")


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_a_model_that_thinks_is_split_by_paged_serve(thinking_model, name):
    """The real engine and server, both parsers: the chat reply, its stream (a delta per token, so every
    marker arrives whole or not at all) and the Responses reasoning item agree on the split."""
    import json

    import httpx

    from tests.serving.server_fixture import Server

    extra = ["--enable-reasoning"] if name == "deepseek_r1" else []  # vLLM's old flag: accepted
    server = Server(thinking_model, "--reasoning-parser", name, "--max-model-len", "128", *extra)
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 30,
                "temperature": 0}
        message = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Let", "The answer is 4")
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as reply:
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in reply.iter_lines()
                      if line.startswith("data: {")]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Let"
        assert "".join(d.get("content") or "" for d in deltas) == "The answer is 4"
        response = httpx.post(server.url + "/v1/responses", timeout=60, json={
            "model": "tiny", "input": "2 + 2?", "temperature": 0, "max_output_tokens": 30}).json()
        reasoning, answer = response["output"]
        assert reasoning["content"][0]["text"] == "Let" and answer["content"][0]["text"] == "The answer is 4"
        with_logprobs = httpx.post(server.url + "/v1/responses", timeout=60, json={
            "model": "tiny", "input": "2 + 2?", "temperature": 0, "max_output_tokens": 30,
            "include": ["message.output_text.logprobs"]}).json()
        tokens = [entry["token"] for entry in with_logprobs["output"][1]["content"][0]["logprobs"]]
        chat = httpx.post(server.url + "/v1/chat/completions", json={**body, "logprobs": True}, timeout=60).json()
        chat_tokens = [entry["token"] for entry in chat["choices"][0]["logprobs"]["content"]]
        # The answer's tokens only: chat's (all of them, the thinking's and EOS's too) after </think>.
        assert tokens == chat_tokens[chat_tokens.index("</think>") + 1:] and "".join(tokens).startswith("The answer")
        # A schema shapes the answer only: the thinking is written as the model wants, then an integer (the
        # model's "The" is masked, so greedy takes the first token the grammar allows, then EOS).
        digit = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9}}}
        for stream in (False, True):
            reply = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                               json={**body, "response_format": digit, "stream": stream})
            if stream:
                deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in reply.text.splitlines()
                          if line.startswith("data: {")]
                message = {"reasoning_content": "".join(d.get("reasoning_content") or "" for d in deltas),
                           "content": "".join(d.get("content") or "" for d in deltas)}
            else:
                message = reply.json()["choices"][0]["message"]
            assert message["reasoning_content"] == "Let", message
            assert 0 <= json.loads(message["content"]) <= 9, message
        structured = httpx.post(server.url + "/v1/responses", timeout=60, json={
            "model": "tiny", "input": "2 + 2?", "temperature": 0, "max_output_tokens": 30,
            "text": {"format": {"type": "json_schema", "name": "n", "schema": digit["json_schema"]["schema"]}}}).json()
        reasoning, answer = structured["output"]
        assert reasoning["content"][0]["text"] == "Let" and 0 <= json.loads(answer["content"][0]["text"]) <= 9
    finally:
        server.stop()
