"""Structured outputs: what a request asks its text to match (vLLM's `StructuredOutputsParams`).

One constraint per request: a JSON schema, any JSON object, a regular expression, one of a list of strings, or
a grammar (Lark, or llama.cpp's GBNF/EBNF). paged/grammar.py compiles it against the tokenizer and the
sampler masks, at every step, the tokens that would leave the language.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# Bounds what one request can make the host compile and hold (the grammar text, a choice list).
MAX_SPEC_CHARS = 1 << 20
MAX_CHOICES = 4096


class InvalidStructuredOutput(ValueError):
    """A constraint that cannot be compiled; `field` names the parameter that holds it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


@dataclasses.dataclass
class StructuredOutputsParams:
    """Exactly one of json, regex, choice, grammar, json_object.

    json: a JSON schema (a dict, or its JSON text). regex: the whole output must match it. choice: the output
    is one of these strings. grammar: Lark, or GBNF/EBNF as llama.cpp writes it. json_object: any JSON object.
    disable_any_whitespace: JSON without whitespace between tokens (by default any JSON whitespace is allowed,
    as vLLM allows it).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises InvalidStructuredOutput naming the field (structured_outputs.<name>)."""
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidStructuredOutput(
                "structured_outputs", "exactly one of json, regex, choice, grammar, json_object must be set, got "
                f"{', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            _check_size("json", self.json)
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise InvalidStructuredOutput("structured_outputs.json", f"not valid JSON: {exc}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise InvalidStructuredOutput("structured_outputs.json", "a JSON schema is an object, got "
                                          f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise InvalidStructuredOutput(f"structured_outputs.{name}", "must be a non-empty string")
                _check_size(name, value)
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice or len(self.choice) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidStructuredOutput("structured_outputs.choice", "must be a list of 1 to "
                                              f"{MAX_CHOICES} non-empty strings, got {self.choice!r:.200}")
            _check_size("choice", "".join(self.choice))
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise InvalidStructuredOutput("structured_outputs.json_object", f"must be a boolean, got "
                                          f"{self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidStructuredOutput("structured_outputs.disable_any_whitespace", "must be a boolean")

    @property
    def kind(self) -> str:
        """Which constraint is set: json, regex, choice, grammar or json_object."""
        return next(name for name in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """The constraint's kind and canonical text (with the whitespace setting, what a grammar compiles from)."""
        value: Any = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return self.kind, text


def _check_size(name: str, text: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidStructuredOutput(f"structured_outputs.{name}", f"is {len(text)} characters; at most "
                                      f"{MAX_SPEC_CHARS} are accepted")
