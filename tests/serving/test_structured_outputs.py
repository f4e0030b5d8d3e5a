"""Structured outputs over HTTP with the official `openai` client against a real `paged serve`."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, Optional

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from paged import LLM, SamplingParams, StructuredOutputsParams
from tests.serving.server_fixture import Server

FLAGS = ["--block-size", "8", "--max-model-len", "512", "--max-num-seqs", "16",
         "--structured-outputs-disable-any-whitespace"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Point(_Strict):
    x: int = Field(ge=-5, le=5)
    y: float = Field(ge=0, le=1.5)


class Shape(_Strict):
    kind: Literal["circle", "square", "line"]
    points: list[Point] = Field(min_length=1, max_length=3)
    label: Optional[str] = Field(default=None, max_length=5)


class Flags(_Strict):
    on: bool
    level: int = Field(ge=0, le=9)
    names: list[Literal["a", "b", "c"]] = Field(max_length=4)


class Nested(_Strict):
    shape: Shape
    flags: Flags
    code: str = Field(min_length=1, max_length=4)


MODELS = [Point, Shape, Flags, Nested]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server(tiny_model_dir, *FLAGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _parse(client, model, seed):
    return client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": f"item {seed}"}],
                                         response_format=model, temperature=1.0, seed=seed, max_tokens=400)


def test_parse_returns_valid_objects_for_100_requests(client):
    jobs = [(MODELS[i % len(MODELS)], i) for i in range(100)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda job: _parse(client, *job), jobs))
    for (model, _), result in zip(jobs, results):
        message = result.choices[0].message
        assert isinstance(message.parsed, model)
        jsonschema.validate(json.loads(message.content), model.model_json_schema())
        assert result.choices[0].finish_reason == "stop"


def test_streamed_json_schema_parses(client):
    schema = Flags.model_json_schema()
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True, temperature=1.0, seed=3,
        max_tokens=200, response_format={"type": "json_schema", "json_schema": {"name": "flags", "schema": schema,
                                                                                "strict": True}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)


def test_regex_choice_and_json_object_on_both_routes(client):
    regex = r"\d{3}-[a-z]{2,4}"
    choices = ["red", "green", "blue violet"]
    for seed in range(6):
        out = client.completions.create(model="tiny", prompt="Hello", max_tokens=40, temperature=1.0, seed=seed,
                                        extra_body={"structured_outputs": {"regex": regex}})
        assert re.fullmatch(regex, out.choices[0].text)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "pick"}],
                                              max_tokens=40, temperature=1.0, seed=seed,
                                              extra_body={"structured_outputs": {"choice": choices}})
        assert chat.choices[0].message.content in choices
        obj = client.completions.create(model="tiny", prompt="JSON:", max_tokens=300, temperature=1.0, seed=seed,
                                        extra_body={"response_format": {"type": "json_object"}})
        if obj.choices[0].finish_reason == "stop":  # any object is unbounded with random weights
            assert isinstance(json.loads(obj.choices[0].text), dict)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"no_such_option": 1}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
])
def test_bad_constraints_are_a_400_naming_the_field_and_the_server_goes_on(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       extra_body=extra)
    assert caught.value.body["param"] == param, caught.value.body
    ok = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_llm_generate_matches_the_server_for_the_same_seed(client, tiny_model_dir):
    llm = LLM(tiny_model_dir, block_size=8, max_model_len=512, max_num_seqs=16,
              structured_outputs_disable_any_whitespace=True, show_progress=False)
    schema = Shape.model_json_schema()
    params = SamplingParams(temperature=1.0, seed=21, max_tokens=300,
                            structured_outputs=StructuredOutputsParams(json=schema))
    want = llm.generate("A shape:", params, use_tqdm=False)[0].outputs[0].text
    got = client.completions.create(model="tiny", prompt="A shape:", max_tokens=300, temperature=1.0, seed=21,
                                    extra_body={"structured_outputs": {"json": schema}}).choices[0].text
    assert got == want
    jsonschema.validate(json.loads(got), schema)


def test_metrics_count_constrained_requests_and_compilations(server, client):
    client.completions.create(model="tiny", prompt="x", max_tokens=20,
                              extra_body={"structured_outputs": {"regex": "metric-[0-9]"}})
    text = httpx.get(server.url + "/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("paged:structured_output") and "_created" not in line}
    assert values['paged:structured_output_requests_total{engine="0",model_name="tiny"}'] >= 1
    assert values['paged:structured_output_grammars_compiled_total{engine="0",model_name="tiny"}'] >= 1
    assert values['paged:structured_output_compile_seconds_total{engine="0",model_name="tiny"}'] > 0
