"""Tool calling on /v1/chat/completions (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`).

`required` and a named function are enforced: the output is constrained by a JSON schema built from the tools'
parameter schemas, so every response carries a call whose arguments validate. `auto` lets the model write what
it wants and a parser (`--tool-call-parser`) finds the calls in its text:
  hermes:      <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number, text around them allowed
               (Qwen2.5/Qwen3, Hermes 2/3 and most chat models trained on that format).
  llama3_json: the whole output is {"name": ..., "parameters": {...}} objects separated by ";", optionally
               after <|python_tag|> (Llama 3.1-3.3's JSON tool calling).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from paged import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def functions_of(tools: list[Any]) -> list[dict[str, Any]]:
    """The `function` objects of OpenAI `tools`; ValueError naming `tools[i]` for a malformed one."""
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        functions.append(function)
    return functions


def tool_choice_mode(tool_choice: str | dict | None, functions: list[dict]) -> tuple[str, str | None]:
    """(mode, function name): mode none, auto, required or named. ValueError for a choice that names no tool."""
    if tool_choice is None:
        return ("auto" if functions else "none"), None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not functions:
            raise ValueError(f"tool_choice={tool_choice!r} needs tools")
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(function, dict) or tool_choice.get("type") != "function":
        raise ValueError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                         "{\"name\": ...}}")
    name = function.get("name")
    if name not in {f["name"] for f in functions}:
        raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")
    return "named", name


def tool_constraint(mode: str, name: str | None, functions: list[dict],
                    parallel_tool_calls: bool) -> StructuredOutputsParams | None:
    """The JSON schema that `required` (a list of calls) and `named` (the function's arguments) impose."""
    if mode == "named":
        function = next(f for f in functions if f["name"] == name)
        return StructuredOutputsParams(json=function.get("parameters") or _EMPTY_PARAMETERS)
    if mode != "required":
        return None
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": f["name"]}, "parameters": f.get("parameters") or _EMPTY_PARAMETERS}}
             for f in functions]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def constrained_calls(mode: str, name: str | None, text: str) -> list[ToolCall]:
    """The calls in a `required` or `named` output. Named: the output is the arguments, as generated (what a
    stream sends too). A `required` list cut short (max_tokens) keeps its complete calls and, as vLLM does,
    the call it was writing once its name is complete, with the arguments so far."""
    if mode == "named":
        return [ToolCall(name, text)]
    calls = []
    decoder = json.JSONDecoder()
    position = _skip_blanks(text, 0)
    if not text.startswith("[", position):
        return []
    position += 1
    while True:
        position = _skip_blanks(text, position)
        try:
            call, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            partial = _PARTIAL_CALL.match(text, position)
            if partial is not None:
                arguments = _PARTIAL_ARGUMENTS.match(partial.group(2))
                calls.append(ToolCall(json.loads(f'"{partial.group(1)}"'), arguments.group(1).rstrip() if arguments else ""))
            return calls
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            calls.append(ToolCall(call["name"], json.dumps(call.get("parameters", {}))))
        position = _skip_blanks(text, position)
        if not text.startswith(",", position):
            return calls
        position += 1


# A call of a `required` list that was cut short: its name (complete), then what it had of the arguments.
_PARTIAL_CALL = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"(.*)\Z', re.DOTALL)
_PARTIAL_ARGUMENTS = re.compile(r'\s*,\s*"parameters"\s*:\s*(.*)\Z', re.DOTALL)


def _skip_blanks(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\n\r":
        position += 1
    return position


class HermesParser:
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
    start = "<tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = []
        for match in self._CALL.finditer(text):
            call = _call_of(match.group(1), "arguments")
            if call is None:
                return text, []  # a malformed call: all of it is content
            calls.append(call)
        if not calls:
            return text, []
        content = self._CALL.sub("", text).strip()
        return content or None, calls

    def content_end(self, text: str) -> int:
        """How much of text is content whatever follows (the rest may begin a call)."""
        found = text.find(self.start)
        if found >= 0:
            return found
        return len(text) - _longest_prefix_suffix(text, self.start)


class Llama3JsonParser:
    start = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        body = body[len(self.start):] if body.startswith(self.start) else body
        if not body.startswith("{"):
            return text, []
        calls = [_call_of(part, "parameters") for part in _split_objects(body)]
        if not calls or any(call is None for call in calls):
            return text, []
        return None, calls

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or body.startswith(self.start) or self.start.startswith(body):
            return 0  # may be a call: hold it all back until the output ends
        return len(text)


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def _call_of(text: str, arguments_key: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    return ToolCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def _split_objects(text: str) -> list[str]:
    """JSON objects separated by ';' (or whitespace)."""
    decoder, parts, i = json.JSONDecoder(), [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            break
        try:
            _, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return [text[i:]]  # unparsable: _call_of rejects it
        parts.append(text[i:end])
        i = end
    return parts


def _longest_prefix_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """Turns one choice's growing text into OpenAI chat-chunk deltas when tools are in play.

    named: the call's id and name first, then the arguments as they are generated. required: the calls once
    the output is complete. auto: content as long as it cannot be the start of a call, the calls at the end.
    """

    def __init__(self, mode: str, name: str | None, parser):
        self.mode, self.name, self.parser = mode, name, parser
        self.sent = 0  # characters of text sent (as content, or as the named call's arguments)
        self.header_sent = False
        self.calls: list[ToolCall] = []

    def deltas(self, text: str, safe_end: int, finished: bool) -> list[dict[str, Any]]:
        out = []
        if self.mode == "named":
            if not self.header_sent:
                self.header_sent = True
                self.calls = [ToolCall(self.name, "")]
                call = self.calls[0]
                out.append({"tool_calls": [{"index": 0, "id": call.id, "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            end = len(text) if finished else safe_end
            if end > self.sent:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text[self.sent:end]}}]})
                self.sent = end
            return out
        if self.mode == "auto" and not finished:
            end = min(safe_end, self.parser.content_end(text))
            if end > self.sent:
                out.append({"content": text[self.sent:end]})
                self.sent = end
            return out
        if not finished:
            return out
        if self.mode == "required":
            calls = constrained_calls("required", None, text)
            content = None if calls else text
        else:
            content, calls = self.parser.parse(text)
        rest = (content or "")[self.sent:] if (content or "").startswith(text[:self.sent]) else ""
        if rest:
            out.append({"content": rest})
        for i, call in enumerate(calls):
            out.append({"tool_calls": [{"index": i, **call.as_dict()}]})
        self.calls = calls
        return out
