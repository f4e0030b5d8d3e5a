"""Third-party clients (openai's parse helper, instructor, langchain-openai, litellm) against a real `paged serve`
at its default structured-output flags (bounded whitespace, schemas without additionalProperties closed).

The tiny model has random weights, so only constrained outputs are checked: every schema below bounds its strings
(enum, Literal or maxLength), so a generation always ends; max_tokens 700 leaves room for the bounded whitespace
(a Report took 228 tokens at the median and 346 at most over 40 seeds; 300 cut about one seed in seven).
These run in their own environment, `make test-clients` (.venv-clients, requirements/clients.txt): instructor
caps jiter below what the main test environment's openai needs, so each library gets the openai its users get.
"""

from __future__ import annotations

import os
from enum import Enum
from typing import Literal, Optional

import openai
import pytest
from pydantic import BaseModel, Field, constr

from tests.serving.server_fixture import Server

FLAGS = ["--block-size", "8", "--max-model-len", "1024"]  # structured-output flags left at their defaults
SEEDS = range(5)
MAX_TOKENS = 700
MESSAGES = [{"role": "user", "content": "Write a report."}]


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Inner(BaseModel):
    level: int = Field(ge=0, le=99, description="a level")
    on: bool


class Item(BaseModel):
    name: constr(max_length=8)
    color: Color
    inner: Inner


class Report(BaseModel):
    """A small report."""  # becomes the schema's (and the tool's) description
    kind: Literal["a", "b"]
    items: list[Item] = Field(min_length=1, max_length=3)
    count: int = Field(ge=0, le=99)
    ok: bool
    shade: Optional[Color] = None  # anyOf [$ref, null]; clients in strict mode make it required


class MakeReportArgs(BaseModel):
    kind: Literal["a", "b"]
    count: int = Field(ge=0, le=99)
    ok: bool


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server(tiny_model_dir, *FLAGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def auto_server(tiny_model_dir):
    srv = Server(tiny_model_dir, *FLAGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _check(report) -> None:
    assert isinstance(report, Report), report
    assert 1 <= len(report.items) <= 3 and all(len(item.name) <= 8 for item in report.items)


# --- openai's own helpers ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_openai_parse(server, seed):
    result = _client(server).chat.completions.parse(
        model="tiny", messages=MESSAGES, response_format=Report, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
    assert result.choices[0].finish_reason == "stop"
    _check(result.choices[0].message.parsed)


@pytest.mark.parametrize("seed", SEEDS)
def test_openai_stream_parse(server, seed):
    with _client(server).chat.completions.stream(model="tiny", messages=MESSAGES, response_format=Report,
                                                 max_tokens=MAX_TOKENS, temperature=1.0, seed=seed) as stream:
        for _ in stream:
            pass
        _check(stream.get_final_completion().choices[0].message.parsed)


# --- instructor -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["TOOLS", "TOOLS_STRICT", "JSON_SCHEMA"])
def test_instructor(server, mode, seed):
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(_client(server), mode=getattr(instructor.Mode, mode))
    _check(client.chat.completions.create(model="tiny", messages=MESSAGES, response_model=Report, max_retries=0,
                                          max_tokens=MAX_TOKENS, temperature=1.0, seed=seed))


# --- langchain-openai -------------------------------------------------------------------------------------------

@pytest.fixture
def chat_openai(server, monkeypatch):
    langchain_openai = pytest.importorskip("langchain_openai")
    import tiktoken

    def offline(*args, **kwargs):  # there is no network here: these paths must not need an encoding
        raise AssertionError("tiktoken encoding requested")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    monkeypatch.setattr(tiktoken, "encoding_for_model", offline)
    return lambda seed, url=server.url: langchain_openai.ChatOpenAI(
        base_url=url + "/v1", api_key="x", model="tiny", temperature=1.0, max_tokens=MAX_TOKENS, seed=seed,
        max_retries=0)


def _make_report_tool():
    from langchain_core.tools import tool

    @tool(args_schema=MakeReportArgs)
    def make_report(kind: str, count: int, ok: bool) -> str:
        """Make a report."""
        return "done"
    return make_report


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kwargs", [{}, {"method": "json_schema"}, {"method": "function_calling"},
                                    {"method": "function_calling", "strict": True}],
                         ids=["default", "json_schema", "function_calling", "function_calling_strict"])
def test_langchain_with_structured_output(chat_openai, kwargs, seed):
    # function_calling turns a cut call into None rather than an error, so the isinstance check matters
    _check(chat_openai(seed).with_structured_output(Report, **kwargs).invoke(MESSAGES))


@pytest.mark.parametrize("seed", SEEDS)
def test_langchain_with_structured_output_streamed(chat_openai, seed):
    chunks = list(chat_openai(seed).with_structured_output(Report, method="json_schema").stream(MESSAGES))
    _check(chunks[-1])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("tool_choice", ["make_report", "any"])
def test_langchain_bind_tools(chat_openai, tool_choice, seed):
    # "any" is sent as "required"; without parallel_tool_calls=False the server may return several calls
    llm = chat_openai(seed).bind_tools([_make_report_tool()], tool_choice=tool_choice, parallel_tool_calls=False)
    message = llm.invoke(MESSAGES)
    assert message.invalid_tool_calls == []
    assert [call["name"] for call in message.tool_calls] == ["make_report"]
    MakeReportArgs.model_validate(message.tool_calls[0]["args"])


@pytest.mark.parametrize("seed", SEEDS)
def test_langchain_bind_pydantic_tool(chat_openai, seed):
    message = chat_openai(seed).bind_tools([Report], tool_choice="Report").invoke(MESSAGES)
    assert [call["name"] for call in message.tool_calls] == ["Report"]
    _check(Report.model_validate(message.tool_calls[0]["args"]))


def test_langchain_auto_tools_need_the_auto_flags(chat_openai):
    # bind_tools without tool_choice sends none, which means "auto": a 400 naming the flags at default settings
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        chat_openai(0).bind_tools([_make_report_tool()]).invoke(MESSAGES)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_langchain_auto_tools_with_hermes(chat_openai, auto_server, seed, stream):
    llm = chat_openai(seed, auto_server.url).bind_tools([_make_report_tool()])
    if stream:
        chunks = list(llm.stream(MESSAGES))
        message = chunks[0]
        for chunk in chunks[1:]:
            message = message + chunk
    else:
        message = llm.invoke(MESSAGES)
    # random weights never write <tool_call>: text comes back as content, with no (invalid) calls
    assert message.tool_calls == [] and message.invalid_tool_calls == []
    assert message.response_metadata["finish_reason"] in ("stop", "length")


# --- litellm ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else it fetches a price list at import
    return pytest.importorskip("litellm")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_litellm_response_format(server, litellm, seed, stream):
    response = litellm.completion(model="openai/tiny", api_base=server.url + "/v1", api_key="x", messages=MESSAGES,
                                  response_format=Report, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
                                  num_retries=0, stream=stream)
    if stream:  # litellm counts the streamed tokens with its bundled cl100k_base: no download
        text = "".join(chunk.choices[0].delta.content or "" for chunk in response)
    else:
        assert response.choices[0].finish_reason == "stop"
        text = response.choices[0].message.content
    _check(Report.model_validate_json(text))


@pytest.mark.parametrize("seed", SEEDS)
def test_litellm_named_tool(server, litellm, seed):
    tools = [{"type": "function", "function": {"name": "make_report", "description": "Make a report.",
                                               "parameters": MakeReportArgs.model_json_schema()}}]
    response = litellm.completion(model="openai/tiny", api_base=server.url + "/v1", api_key="x", messages=MESSAGES,
                                  tools=tools, tool_choice={"type": "function", "function": {"name": "make_report"}},
                                  max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, num_retries=0)
    calls = response.choices[0].message.tool_calls
    assert [call.function.name for call in calls] == ["make_report"]
    MakeReportArgs.model_validate_json(calls[0].function.arguments)
