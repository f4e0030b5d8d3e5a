"""POST /v1/responses through the official openai client: replies and streams validate against the library's
own types, say what the chat route says for the same conversation, and unserved fields are a 400."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.serving.server_fixture import Server

GREEDY = {"temperature": 0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server(tiny_model_dir, "--max-model-len", "256", "--max-num-seqs", "8")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _chat_text(client, messages, max_tokens=12) -> str:
    reply = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=max_tokens)
    return reply.choices[0].message.content


def test_a_plain_input_says_what_chat_says(client):
    raw = client.responses.with_raw_response.create(model="tiny", input="Tell me about paged attention", **GREEDY)
    Response.model_validate(raw.http_response.json())  # every field the library requires is there
    response = raw.parse()
    assert response.object == "response" and response.id.startswith("resp_")
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant"
    assert response.output_text == _chat_text(client, [{"role": "user", "content": "Tell me about paged attention"}])
    assert response.usage.output_tokens == 12 and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"


def test_instructions_and_message_items_become_the_conversation(client):
    response = client.responses.create(model="tiny", instructions="Answer briefly.", input=[
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
        {"role": "developer", "content": "Be kind."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is a page?"}]},
    ], **GREEDY)
    want = _chat_text(client, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello"},
                               {"role": "assistant", "content": "Hi."}, {"role": "system", "content": "Be kind."},
                               {"role": "user", "content": "What is a page?"}])
    assert response.output_text == want


def test_a_json_schema_format_constrains_the_text(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    response = client.responses.create(model="tiny", input="A record, please", temperature=0, max_output_tokens=60,
                                       text={"format": {"type": "json_schema", "name": "record", "schema": schema,
                                                        "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def test_a_stream_is_the_responses_event_sequence(client, server):
    import httpx
    body = {"model": "tiny", "input": "Tell me about paged attention", "stream": True, **GREEDY}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)  # each one is a type the library knows, with every required field
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert streamed == events[-1]["response"]["output"][0]["content"][0]["text"]
    assert streamed == client.responses.create(model="tiny", input="Tell me about paged attention",
                                               **GREEDY).output_text
    # The library's own stream helper reads a completed one (it gives no final response for an incomplete
    # one, OpenAI's own included).
    record = {"type": "json_schema", "name": "r", "strict": True, "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}, "required": ["n"],
        "additionalProperties": False}}
    with client.responses.stream(model="tiny", input="A number", temperature=0, max_output_tokens=40,
                                 text={"format": record}) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and "n" in json.loads(final.output_text)
    assert final.output_text == client.responses.create(model="tiny", input="A number", temperature=0,
                                                        max_output_tokens=40, text={"format": record}).output_text


@pytest.mark.parametrize("extra, field", [
    # auto (the default once tools are given) needs a server started with a tool-call parser, as in vLLM
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}, "tool_choice"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}}, "text"),
])
def test_what_is_not_served_is_a_400_naming_the_field(client, extra, field):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**{"model": "tiny", "input": "hi", **extra})
    assert caught.value.body["param"] == field, caught.value.body


def test_reasoning_becomes_its_own_output_item(tiny_model_dir):
    """With --reasoning-parser, the thinking is a reasoning item before the message, streamed as
    reasoning_text events (a scripted engine stands in for a reasoning model)."""
    import asyncio

    import httpx
    from transformers import AutoTokenizer

    from paged.serving.app import build_app
    from tests.serving.test_reasoning import PIECES, _ScriptedEngine

    app = build_app(_ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir), PIECES), "tiny",
                    reasoning_parser="qwen3")

    async def ask(stream: bool):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
            return await client.post("/v1/responses", json={"model": "tiny", "input": "2 + 2?", "stream": stream})

    response = Response.model_validate(asyncio.run(ask(False)).json())
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Let me think."
    assert message.type == "message" and response.output_text == "\n\nThe answer is 4."
    events = [json.loads(line[6:]) for line in asyncio.run(ask(True)).text.splitlines() if line.startswith("data: ")]
    for event in events:
        TypeAdapter(ResponseStreamEvent).validate_python(event)
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Let me think."
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "\n\nThe answer is 4."
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and [i["type"] for i in final["output"]] == ["reasoning",
                                                                                                  "message"]


WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {},
                                                               "additionalProperties": False}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_tools_come_back_as_function_call_items(client, choice):
    raw = client.responses.with_raw_response.create(model="tiny", input="Weather in Paris?", tools=[WEATHER, TIME],
                                                     tool_choice=choice, temperature=0, max_output_tokens=80,
                                                     parallel_tool_calls=False)
    Response.model_validate(raw.http_response.json())
    response = raw.parse()
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and len(calls) == 1, response.output
    (call,) = calls
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert call.name == "get_weather" or choice == "required"
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, (WEATHER if call.name == "get_weather" else TIME)["parameters"])
    assert [t.name for t in response.tools] == ["get_weather", "get_time"]


def test_a_tool_output_goes_back_into_the_next_turn(client, server):
    first = client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER], temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    (call,) = first.output
    follow_up = [{"role": "user", "content": "Weather in Paris?"},
                 {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                 {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}]
    second = client.responses.create(model="tiny", input=follow_up, tools=[WEATHER], tool_choice="none",
                                     temperature=0, max_output_tokens=8)
    assert second.output[0].type == "message"
    # The chat route given the same turns (an assistant tool call and the tool's reply) says the same.
    chat = client.chat.completions.create(model="tiny", temperature=0, max_tokens=8, tool_choice="none",
                                          tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                                                   if k != "type"}}],
                                          messages=[{"role": "user", "content": "Weather in Paris?"},
                                                    {"role": "assistant", "content": None, "tool_calls": [{
                                                        "id": call.call_id, "type": "function", "function": {
                                                            "name": call.name, "arguments": call.arguments}}]},
                                                    {"role": "tool", "tool_call_id": call.call_id,
                                                     "content": "18 C and sunny"}])
    assert second.output_text == chat.choices[0].message.content


def test_a_streamed_call_arrives_as_function_call_events(client, server):
    import httpx
    body = {"model": "tiny", "input": "Weather in Paris?", "tools": [WEATHER], "temperature": 0,
            "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 60, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as reply:
        events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]
    for event in events:
        TypeAdapter(ResponseStreamEvent).validate_python(event)
    kinds = [e["type"] for e in events]
    # A named call's arguments stream as they are generated (a delta per step), as chat's do.
    deltas = kinds.count("response.function_call_arguments.delta")
    assert kinds[2:] == ["response.output_item.added", *["response.function_call_arguments.delta"] * deltas,
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"] and deltas > 2, kinds
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    whole = client.responses.create(**{k: v for k, v in body.items() if k != "stream"})
    assert done["arguments"] == streamed == whole.output[0].arguments
    assert events[-1]["response"]["output"][0]["call_id"] == events[2]["item"]["call_id"]


def test_a_stored_response_is_read_back_continued_and_deleted(client):
    first = client.responses.create(model="tiny", instructions="Answer briefly.", input="Hello", **GREEDY)
    assert first.store and client.responses.retrieve(first.id) == first
    second = client.responses.create(model="tiny", input="What is a page?", previous_response_id=first.id,
                                     **GREEDY)
    assert second.previous_response_id == first.id
    # The earlier turn's input and output come first; its instructions do not carry over (as OpenAI's).
    assert second.output_text == _chat_text(client, [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is a page?"}])
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="tiny", input="And?", previous_response_id=first.id, **GREEDY)
    assert caught.value.body["param"] == "previous_response_id"
    assert client.responses.retrieve(second.id) == second  # a continuation is stored whole: it stands alone


def test_a_tool_output_continues_a_stored_call(client):
    first = client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER], temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    (call,) = first.output
    second = client.responses.create(model="tiny", previous_response_id=first.id, tools=[WEATHER],
                                     tool_choice="none", temperature=0, max_output_tokens=8, input=[
                                         {"type": "function_call_output", "call_id": call.call_id,
                                          "output": "18 C and sunny"}])
    spelled_out = client.responses.create(model="tiny", tools=[WEATHER], tool_choice="none", temperature=0,
                                          max_output_tokens=8, input=[
                                              {"role": "user", "content": "Weather in Paris?"},
                                              {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                               "arguments": call.arguments},
                                              {"type": "function_call_output", "call_id": call.call_id,
                                               "output": "18 C and sunny"}])
    assert second.output_text == spelled_out.output_text


def test_store_false_and_a_stream_are_kept_as_asked(client):
    unstored = client.responses.create(model="tiny", input="Hello", store=False, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with client.responses.stream(model="tiny", input="Hello", **GREEDY) as stream:
        *_, last = stream  # response.incomplete: the reply is cut at max_output_tokens
    assert client.responses.retrieve(last.response.id) == last.response


def test_output_text_logprobs_are_chats_streamed_or_not(client):
    ask = dict(model="tiny", input="Tell me about paged attention", include=["message.output_text.logprobs"],
               top_logprobs=3, **GREEDY)
    raw = client.responses.with_raw_response.create(**ask)
    Response.model_validate(raw.http_response.json())
    logprobs = [entry.model_dump() for entry in raw.parse().output[0].content[0].logprobs]
    chat = client.chat.completions.create(model="tiny", temperature=0, max_tokens=12, logprobs=True, top_logprobs=3,
                                          messages=[{"role": "user", "content": "Tell me about paged attention"}])
    assert logprobs == [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    assert len(logprobs) == 12 and all(len(entry["top_logprobs"]) == 3 for entry in logprobs)
    with client.responses.stream(**ask) as stream:
        events = list(stream)
    streamed = [entry.model_dump() for e in events if e.type == "response.output_text.delta" for entry in e.logprobs]
    assert streamed == logprobs
    assert [entry.model_dump() for entry in events[-1].response.output[0].content[0].logprobs] == logprobs
