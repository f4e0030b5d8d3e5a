"""OpenAI request bodies as pydantic models; conversion to SamplingParams."""

from __future__ import annotations

import json
import re
from itertools import chain, repeat
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, PlainValidator, Tag, TypeAdapter, field_validator

from paged import SamplingParams, StructuredOutputsParams
from paged.structured_outputs import InvalidStructuredOutput


# Unknown fields are ignored, as OpenAI does. Known ones are strict: no string-to-number or bool-to-int
# coercion ("max_tokens": "10" or true, "stream": "yes", prompt [true, false] are a 400, not a guess).
_STRICT = ConfigDict(extra="ignore", strict=True)


def _encodable(value, where: str = "body") -> None:
    """ValueError naming where a string holds a lone surrogate ("\\ud800" in JSON): valid JSON, yet no text,
    and nothing downstream (tokenizers, logs, the reply) can encode it."""
    if isinstance(value, list) and _holds_only_text_or_numbers(value):
        return  # the common large bodies (token ids, batches of them, of strings) checked at C speed
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where} holds a lone UTF-16 surrogate, which is not text") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _encodable(key, where)
            _encodable(item, f"{where}.{key}" if isinstance(key, str) and key.isidentifier() else where)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _encodable(item, f"{where}[{i}]")


def _holds_only_text_or_numbers(items: list) -> bool:
    """True when `items` is numbers, valid strings, or lists of numbers: the shapes of a prompt, checked
    without a Python-level step per element (a 4 MiB body holds a million ids)."""
    if all(map(isinstance, items, repeat((int, float)))):
        return True
    if all(map(isinstance, items, repeat(str))):
        try:
            "".join(items).encode("utf-8")
            return True
        except UnicodeEncodeError:
            return False  # the walk names the string that is not text
    return (all(map(isinstance, items, repeat(list)))
            and all(map(isinstance, chain.from_iterable(items), repeat((int, float)))))


def _prompt_shape(value) -> str:
    """Which of the prompt's four shapes a value claims, from its first element: pydantic then validates that
    shape alone (trying every shape on a million ids built a million errors per failed shape: half a second)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value:
        if isinstance(value[0], str):
            return "texts"
        if isinstance(value[0], list):
            return "token_id_lists"
    return "token_ids"


def _token_id_lists(value):
    """Strict list[list[int]] at C speed (pydantic takes about a microsecond per inner list: half a second for
    a 4 MiB batch); anything else goes to pydantic for its error."""
    if (isinstance(value, list) and all(map(isinstance, value, repeat(list)))
            and all(map(isinstance, chain.from_iterable(value), repeat(int)))
            and not any(map(isinstance, chain.from_iterable(value), repeat(bool)))):
        return value
    return _TOKEN_ID_LISTS.validate_python(value, strict=True)


_TOKEN_ID_LISTS = TypeAdapter(list[list[int]])

# str | list[str] | list[int] | list[list[int]], discriminated by its shape.
Prompt = Annotated[Union[Annotated[str, Tag("text")], Annotated[list[str], Tag("texts")],
                         Annotated[list[int], Tag("token_ids")],
                         Annotated[list[list[int]], PlainValidator(_token_id_lists, json_schema_input_type=list[list[int]]),
                                   Tag("token_id_lists")]],
                   Discriminator(_prompt_shape)]


class _TextOnly(BaseModel):
    """Refuses (400, naming the field) a body holding strings that are not text, before any field reads them."""

    @field_validator("*", mode="before")
    @classmethod
    def _only_text(cls, value, info):
        _encodable(value, f"body.{info.field_name}")
        return value


class _Request(_TextOnly):
    model_config = _STRICT

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**32)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: str | None = None
    # Token ids as JSON object keys (strings), each bias in OpenAI's range.
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # Extensions vLLM users rely on.
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)  # an int32 per row
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}},
    # and vLLM's own field (json, regex, choice, grammar, json_object, disable_any_whitespace).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # Tool calling (chat only; serving/tool_calls.py).
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: the top k logprobs of each prompt token (bounded by the server's --max-logprobs).
    prompt_logprobs: int | None = Field(default=None, ge=0)
    # vLLM's: prefix-cache blocks are shared only among requests with the same salt (tenant isolation).
    cache_salt: str | None = Field(default=None, min_length=1)
    # Fields that change what a request means and are not implemented yet: accepted by the schema so that
    # they get a 400 naming them (`unimplemented_field`), never silently ignored.
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None

    def unimplemented_field(self) -> str | None:
        """The first field set to something this server does not implement (None: all is served as asked).

        Tools are served on /v1/chat/completions only.
        """
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                return name
        return None

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty or 1.0, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            logit_bias=self._logit_bias(), structured_outputs=self.structured_outputs_params())

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The constraint of response_format or structured_outputs (InvalidStructuredOutput naming the
        request's field if it is malformed)."""
        if self.structured_outputs is not None:
            if self.response_format is not None and self.response_format.get("type") != "text":
                raise InvalidStructuredOutput("structured_outputs", "pass either response_format or "
                                              "structured_outputs, not both")
            try:
                return StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise InvalidStructuredOutput("structured_outputs", str(exc)) from None
        return response_format_params(self.response_format)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        bad = [key for key in bias or {} if not re.fullmatch(r"[0-9]{1,10}", key)]  # ASCII digits only
        if bad:
            raise ValueError(f"keys must be token ids (non-negative integers), got {bad[0]!r}")
        return bias

    def _logit_bias(self) -> dict[int, float]:
        return {int(key): value for key, value in (self.logit_bias or {}).items()}


def response_format_params(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format as a constraint (None for text)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidStructuredOutput("response_format", "json_schema.schema must be a JSON schema object")
        try:
            return StructuredOutputsParams(json=schema)
        except InvalidStructuredOutput as exc:
            raise InvalidStructuredOutput("response_format", str(exc)) from None
    raise InvalidStructuredOutput("response_format", f"type must be text, json_object or json_schema, got {kind!r}")


# The most prompts a completions batch may hold whatever --max-prompts-per-request says: a longer one is
# refused by its length alone, before any of its elements is looked at.
MAX_BATCH_PROMPTS = 65536


class CompletionRequest(_Request):
    prompt: Prompt

    @field_validator("prompt", mode="before")
    @classmethod
    def _bounded_batch(cls, value):
        if isinstance(value, list) and len(value) > MAX_BATCH_PROMPTS and value and isinstance(value[0], (str, list)):
            raise ValueError(f"a batch holds at most {MAX_BATCH_PROMPTS} prompts, got {len(value)}")
        return value
    max_tokens: int | None = Field(default=16, ge=0)  # 0 only with echo: the prompt's logprobs alone (vLLM's)
    logprobs: int | None = Field(default=None, ge=0)  # up to the server's --max-logprobs
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unimplemented_field(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.tools:
            return "tools"  # a completion has no template to show them to, nor a message to return calls in
        if self.tool_choice is not None and self.tool_choice != "none":
            return "tool_choice"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return super().unimplemented_field()


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)  # up to the server's --max-logprobs
    add_generation_prompt: bool = True
    chat_template: str | None = None


# The one `include` value the Responses route serves: logprobs on the output text's tokens.
OUTPUT_TEXT_LOGPROBS = "message.output_text.logprobs"


class ResponsesRequest(_Request):
    """OpenAI's Responses API body (POST /v1/responses), with the sampling extensions of the other routes."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    # {"format": {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}}
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool = True  # kept for previous_response_id and GET /v1/responses/{id} (serving/response_store.py)
    previous_response_id: str | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    truncation: Literal["disabled", "auto"] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Not implemented: a 400 naming the field when set (`unimplemented_field`).
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    include: list[str] | None = None
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None

    def unimplemented_field(self) -> str | None:
        """Fields this route does not serve yet; each is a 400 naming it rather than a silent difference."""
        if self.n != 1:
            return "n"
        if self.truncation == "auto":
            return "truncation"
        for name in ("conversation", "prompt", "max_tool_calls"):
            if getattr(self, name) is not None:
                return name
        if self.background:
            return "background"
        if set(self.include or ()) - {OUTPUT_TEXT_LOGPROBS}:
            return "include"
        if self.reasoning and any(value is not None for value in self.reasoning.values()):
            return "reasoning"
        return super().unimplemented_field()

    def wants_logprobs(self) -> bool:
        """Whether output_text parts carry their tokens' logprobs (`include`, with `top_logprobs` wide)."""
        return OUTPUT_TEXT_LOGPROBS in (self.include or ())

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """text.format as a constraint (the Responses spelling of response_format: name, schema and strict
        beside the type)."""
        if self.text is None or self.text.get("format") is None:
            return super().structured_outputs_params()
        fmt = self.text["format"]
        if not isinstance(fmt, dict):
            raise InvalidStructuredOutput("text", "text.format must be an object")
        if self.response_format is not None or self.structured_outputs is not None:
            raise InvalidStructuredOutput("text", "pass text.format or response_format / structured_outputs, "
                                                  "not both")
        if fmt.get("type") == "json_schema":
            spec = {key: fmt[key] for key in ("name", "schema", "strict") if key in fmt}
            try:
                return response_format_params({"type": "json_schema", "json_schema": spec})
            except InvalidStructuredOutput as exc:
                raise InvalidStructuredOutput("text", exc.detail) from None
        try:
            return response_format_params({"type": fmt.get("type")})
        except InvalidStructuredOutput as exc:
            raise InvalidStructuredOutput("text", f"text.format: {exc.detail}") from None

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """`tools` in chat's shape ({"type": "function", "function": {...}}); ValueError naming a tool that is
        not a function (built-in tools such as web_search are not served)."""
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                got = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
                raise ValueError(f"tools[{i}] is a {got!r} tool; this server calls function tools only")
            out.append({"type": "function", "function": {key: tool[key] for key in
                                                         ("name", "description", "parameters", "strict")
                                                         if key in tool}})
        return out

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        """`tool_choice` in chat's shape; ValueError for a choice of a built-in tool."""
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") == "function" and "function" not in choice:
            return {"type": "function", "function": {"name": choice.get("name")}}
        if choice.get("type") == "function":
            return choice
        raise ValueError(f"tool_choice of type {choice.get('type')!r} is not served; choose none, auto, required "
                         "or a function")

    def input_items(self) -> list[dict[str, Any]]:
        """`input` as a list of items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return self.input

    def messages(self, earlier: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
        """`instructions`, then the `earlier` items (a stored conversation this request continues), then
        `input`, as chat-template messages: message items, the model's earlier function_call items (an
        assistant message's tool_calls) and function_call_output items (tool messages); reasoning items are
        passed over (templates drop earlier turns' thinking). ValueError naming an item this server does not
        read (`input[i]` counts from the first of this request's own items)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        for i, item in enumerate([*earlier, *self.input_items()], start=-len(earlier)):
            kind = item.get("type", "message")
            if kind == "reasoning":
                continue
            if kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
                if not all(isinstance(v, str) for v in (call["id"], *call["function"].values())):
                    raise ValueError(f"input[{i}]: a function_call needs call_id, name and arguments as strings")
                if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                    messages[-1]["tool_calls"].append(call)  # parallel calls of one turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                continue
            if kind == "function_call_output":
                if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
                    raise ValueError(f"input[{i}]: a function_call_output needs call_id and output as strings")
                messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
                continue
            if kind != "message":
                raise ValueError(f"input[{i}] is a {kind!r} item; this server reads messages, function_call and "
                                 "function_call_output items")
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"input[{i}].role must be user, system, developer or assistant, got {role!r}")
            content = item.get("content")
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                        got = part.get("type") if isinstance(part, dict) else type(part).__name__
                        raise ValueError(f"input[{i}].content[{j}] is a {got!r} part; this server reads text only")
                    parts.append(str(part.get("text", "")))
                content = "".join(parts)
            if not isinstance(content, str):
                raise ValueError(f"input[{i}].content must be text or a list of text parts")
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        if not messages:
            raise ValueError("input holds no message")
        for message in messages:  # templates index a call's arguments: JSON text -> an object
            if "tool_calls" in message:
                message["tool_calls"] = [_with_parsed_arguments(call) for call in message["tool_calls"]]
        return messages


class TokenizeRequest(_TextOnly):
    model_config = _STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_TextOnly):
    model_config = _STRICT

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_TextOnly):
    model_config = _STRICT

    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # vLLM's reload of a name in place: refused below when the name is taken


class UnloadLoRAAdapterRequest(_TextOnly):
    model_config = _STRICT

    lora_name: str = ""
    lora_int_id: int | None = None


def non_text_part(messages: list[ChatMessage]) -> str | None:
    """The type of the first content part that is not text (an image, audio, a file), or None."""
    for message in messages:
        for part in message.content if isinstance(message.content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "input_text"):
                return str(kind)
    return None


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for the chat template; list-of-parts content is flattened to its text parts (anything else
    is refused first: `non_text_part`)."""
    out = []
    for message in messages:
        item = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            item["content"] = "".join(part.get("text", "") for part in message.content
                                      if part.get("type") in ("text", "input_text"))
        if isinstance(item.get("tool_calls"), list):  # templates index the arguments: JSON text -> an object
            item["tool_calls"] = [_with_parsed_arguments(call) for call in item["tool_calls"]]
        out.append(item)
    return out


def _with_parsed_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


# ---- responses (for the OpenAPI document: clients and fuzzers read it) ----------------------------------

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the server sends, whatever the status (OpenAI's shape)."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Choice(BaseModel):
    index: int
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


# vLLM's prompt_logprobs: null for the first prompt token, then {token id: {logprob, rank, decoded_token}}.
PromptLogprobs = list[dict[str, dict[str, Any]] | None] | None


class CompletionChoice(_Choice):
    text: str
    prompt_logprobs: PromptLogprobs = None


class _Completion(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage | None = None


class CompletionResponse(_Completion):
    """The non-streamed body; with "stream": true the route sends `text/event-stream` chunks of the same
    shape (`data: {...}` lines, then `data: [DONE]`; a failure mid-stream is a final `data: {"error": ...}`)."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None
    # [{"id", "type": "function", "function": {"name", "arguments" (JSON text)}}]; streamed as deltas
    # {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]} with arguments in pieces.
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(_Choice):
    message: ChatMessageOut


class ChatCompletionResponse(_Completion):
    """The non-streamed body; streamed as `chat.completion.chunk` events (see CompletionResponse)."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobs = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str
