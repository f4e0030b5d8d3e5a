"""Tool calling over HTTP with the official `openai` client against a real `paged serve`."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from paged.serving.tool_calls import HermesParser, Llama3JsonParser, ToolCallStream
from tests.serving.server_fixture import Server

FLAGS = ["--block-size", "8", "--max-model-len", "1024", "--max-num-seqs", "16",
         "--structured-outputs-disable-any-whitespace", "--trust-request-chat-template",
         "--enable-auto-tool-choice"]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8},
                          "unit": {"enum": ["c", "f"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": -9, "maximum": 99}, "b": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# Renders the tools and tool results, so what reaches the template can be checked token by token.
TEMPLATE = ("{% if tools %}<|system|>\n{{ tools | tojson }}</s>\n{% endif %}{% for m in messages %}<|{{ m['role'] }}|>\n"
            "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.name }}({{ c.function.arguments | tojson }})"
            "{% endfor %}{% endif %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}{{ m['content'] or '' }}</s>\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module", params=["hermes", "llama3_json"])
def served(request, tiny_model_dir):
    srv = Server(tiny_model_dir, *FLAGS, "--tool-call-parser", request.param)
    yield request.param, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    srv.stop()


def _calls_of_stream(chunks):
    """Tool calls and finish reason rebuilt from streamed deltas, as OpenAI's SDK helpers accumulate them."""
    calls, reason, content = {}, None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] = delta.function.name or call["name"]
                    call["arguments"] += delta.function.arguments or ""
            reason = choice.finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason, content


def _create(client, stream, **kwargs):
    args = dict(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0, **{"max_tokens": 300, **kwargs})
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]
        return calls, choice.finish_reason, choice.message.content
    return _calls_of_stream(client.chat.completions.create(stream=True, **args))


@pytest.mark.parametrize("stream", [False, True])
def test_required_always_calls_a_tool_with_valid_arguments(served, stream):
    _, client = served
    for seed in range(8):
        parallel = seed % 2 == 0
        calls, reason, _ = _create(client, stream, tool_choice="required", seed=seed, parallel_tool_calls=parallel)
        assert reason == "tool_calls" and calls
        assert parallel or len(calls) == 1
        for call in calls:
            assert call["id"].startswith("call_")
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_always_called(served, stream):
    _, client = served
    for seed in range(6):
        calls, reason, content = _create(client, stream, seed=seed,
                                         tool_choice={"type": "function", "function": {"name": "add"}})
        assert reason == "tool_calls" and not content and [c["name"] for c in calls] == ["add"]
        jsonschema.validate(json.loads(calls[0]["arguments"]), ADD)


def test_streamed_arguments_equal_the_non_streamed(served):
    """Seeded sampling gives the same tokens both ways: the arguments are the same text, as generated."""
    _, client = served
    for seed in range(3):
        named = {"type": "function", "function": {"name": "get_weather"}}
        whole, _, _ = _create(client, False, seed=seed, tool_choice=named)
        streamed, _, _ = _create(client, True, seed=seed, tool_choice=named)
        assert [c["arguments"] for c in streamed] == [c["arguments"] for c in whole]


@pytest.mark.parametrize("stream", [False, True])
def test_calls_cut_by_max_tokens_keep_their_partial_arguments(served, stream):
    """As vLLM does: tool_calls with the arguments generated so far, finish_reason "length"."""
    _, client = served
    for seed in range(3):
        calls, reason, content = _create(client, stream, seed=seed, max_tokens=3,
                                         tool_choice={"type": "function", "function": {"name": "add"}})
        assert reason == "length" and not content
        assert [c["name"] for c in calls] == ["add"] and calls[0]["arguments"].startswith("{")
        with pytest.raises(json.JSONDecodeError):
            json.loads(calls[0]["arguments"])
    calls, reason, _ = _create(client, False, seed=0, max_tokens=30, tool_choice="required")
    assert reason == "length" and calls and calls[-1]["name"] in SCHEMAS


def test_required_lists_cut_short_parse_what_they_have():
    from paged.serving.tool_calls import constrained_calls
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather", "parameters": {"city": "Pa'
    calls = constrained_calls("required", None, text)
    assert [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1, "b": 2}'),
                                                      ("get_weather", '{"city": "Pa')]
    assert constrained_calls("required", None, '[{"name": "ad') == []
    assert [(c.name, c.arguments) for c in constrained_calls("required", None, '[{"name": "add", ')] == [("add", "")]
    assert constrained_calls("required", None, "") == []


FORMATTED = {
    "hermes": 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
                   '{"name": "add", "parameters": {"a": 1, "b": 2}}',
}


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_calls_written_in_the_parsers_format(served, stream):
    """The model is made to write the parser's format (a choice constraint); auto must find both calls."""
    parser, client = served
    calls, reason, content = _create(client, stream, tool_choice="auto",
                                     extra_body={"structured_outputs": {"choice": [FORMATTED[parser]]}})
    assert reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]
    assert (content or None) == ("Let me check." if parser == "hermes" else None)
    # Text that is not a call stays content.
    calls, reason, content = _create(client, stream, tool_choice="auto",
                                     extra_body={"structured_outputs": {"choice": ["No tools needed."]}})
    assert not calls and content == "No tools needed." and reason == "stop"


def test_the_template_gets_the_tools_and_the_tool_messages(served, tiny_model_dir):
    _, client = served
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    out = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                         max_tokens=2, extra_body={"chat_template": TEMPLATE})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected_messages = json.loads(json.dumps(history))
    expected_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "unit": "c"}
    text = tokenizer.apply_chat_template(expected_messages, tools=TOOLS, chat_template=TEMPLATE, tokenize=False,
                                         add_generation_prompt=True)
    assert "21 degrees" in text and "[call_1]" in text and '"city": "Paris"' in text and "get_weather" in text
    assert out.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("kwargs, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(served, kwargs, param):
    _, client = served
    args = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3, "tools": TOOLS, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**args)
    assert caught.value.body["param"] == param, caught.value.body


def test_parsers_leave_malformed_calls_as_content():
    assert HermesParser().parse('<tool_call>{"name": "f", "arguments": {</tool_call>')[1] == []
    assert Llama3JsonParser().parse('{"name": "f"')[1] == []
    assert Llama3JsonParser().parse('Sure: {"name": "f", "parameters": {}}')[1] == []
    content, calls = Llama3JsonParser().parse('<|python_tag|>{"name": "f", "parameters": {"x": 1}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})]


def test_auto_stream_holds_back_only_what_may_start_a_call():
    stream = ToolCallStream("auto", None, HermesParser())
    text = "Hello <tool"
    assert stream.deltas(text, len(text), False) == [{"content": "Hello "}]
    text += '_call>{"name": "f", "arguments": {}}</tool_call>'
    assert stream.deltas(text, len(text), False) == []
    final = stream.deltas(text, len(text), True)
    assert [d["tool_calls"][0]["function"]["name"] for d in final if "tool_calls" in d] == ["f"]
