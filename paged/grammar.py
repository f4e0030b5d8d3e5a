"""Grammar compilation and per-request matching for structured outputs, on llguidance.

Why llguidance (vLLM's "guidance" backend) and not xgrammar (vLLM's default): xgrammar 0.2.9 imports torch
when it is imported (xgrammar/matcher.py, xgrammar/testing.py), and torch is never a runtime dependency of
this engine. llguidance has no Python dependencies, compiles JSON schemas, regexes, choices and Lark/GBNF
grammars against a Hugging Face fast tokenizer, and fills the same packed bitmask from numpy: int32 words,
bit i % 32 of word i // 32 set when token i may come next.

A compiled grammar is cached by its constraint (StructuredOutputsParams.key); each request's matcher is a
copy of the cached one, advanced on the host by every token the request accepts.
"""

from __future__ import annotations

import collections
import hashlib
import threading
import time

import numpy as np

from paged.structured_outputs import InvalidStructuredOutput, StructuredOutputsParams

# Compiled grammars kept (least recently used dropped first): a server sees a few schemas many times. Bounded
# by count and by the bytes of their specs: a compiled grammar's memory grows with its spec (a 600 KB regex
# compiles to ~9 MB), so a few large specs cannot hold gigabytes.
CACHE_SIZE = 256
CACHE_SPEC_BYTES = 8 * 2**20

# Whitespace between JSON tokens by default: nothing, one space, or one newline and an indent of up to 24
# spaces or tabs. That covers compact JSON, json.dumps' ", " / ": " and pretty-printing to 12 levels at
# indent 2; what it rules out is a run of blanks, which is where small models loop until max_tokens.
JSON_WHITESPACE = r"(?:\n[ \t]{0,24}| )?"


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe (the server compiles off the engine thread).

    vocab_size: the model's logits width; token ids the tokenizer lacks are never allowed.
    eos_token_ids: allowed exactly where the grammar may end.
    disable_any_whitespace: JSON constraints allow no whitespace (a request can also ask for it).
    any_whitespace: JSON constraints allow any JSON whitespace (default: JSON_WHITESPACE).
    additional_properties: schemas without additionalProperties stay open to undeclared keys (default: closed).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 disable_any_whitespace: bool = False, any_whitespace: bool = False,
                 additional_properties: bool = False):
        self._tokenizer = tokenizer
        self.vocab_size = max(vocab_size, len(tokenizer))
        self._eos_token_ids = list(eos_token_ids)
        self.disable_any_whitespace = disable_any_whitespace
        self.any_whitespace = any_whitespace
        self.additional_properties = additional_properties
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        # key -> (compiled matcher, its spec's bytes)
        self._cache: collections.OrderedDict[tuple, tuple[object, int]] = collections.OrderedDict()
        self.cache_spec_bytes = 0  # the specs' bytes of what the cache holds
        self.num_compiled = 0
        self.compile_seconds = 0.0  # summed over compilations (cache hits cost nothing)

    @property
    def mask_words(self) -> int:
        """int32 words of one row's bitmask."""
        return (self.vocab_size + 31) // 32

    def _tokenizer_for_llguidance(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf
                from transformers import PreTrainedTokenizerFast
                if not isinstance(self._tokenizer, PreTrainedTokenizerFast):
                    raise ValueError("structured outputs need a fast (tokenizers-backed) tokenizer, got "
                                     f"{type(self._tokenizer).__name__}")
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_ids or None)
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of `params` (cached); raises InvalidStructuredOutput naming the field."""
        compact = params.disable_any_whitespace or self.disable_any_whitespace
        kind, text = params.key
        spec_bytes = len(text.encode("utf-8", "surrogatepass"))
        # The spec's digest, not its text: the key of a 600 KB regex stays 32 bytes.
        key = (kind, hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest(), compact, self.any_whitespace,
               self.additional_properties)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key][0]
        import llguidance
        tokenizer = self._tokenizer_for_llguidance()
        start = time.perf_counter()
        field = f"structured_outputs.{params.kind}"
        whitespace = "none" if compact else "any" if self.any_whitespace else "bounded"
        grammar = _grammar_text(params, field, whitespace, self.additional_properties)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidStructuredOutput(field, matcher.get_error())
        elapsed = time.perf_counter() - start
        with self._lock:
            self.num_compiled += 1
            self.compile_seconds += elapsed
            if key not in self._cache and spec_bytes <= CACHE_SPEC_BYTES:
                self._cache[key] = (matcher, spec_bytes)
                self.cache_spec_bytes += spec_bytes
            while len(self._cache) > CACHE_SIZE or self.cache_spec_bytes > CACHE_SPEC_BYTES:
                self.cache_spec_bytes -= self._cache.popitem(last=False)[1][1]
        return matcher

    def matcher(self, params: StructuredOutputsParams) -> "GrammarMatcher":
        """A fresh matcher at the start of `params`' grammar."""
        return GrammarMatcher(self.compile(params).deep_copy(), self.mask_words)


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher, mask_words: int):
        self._matcher = matcher
        self.mask_words = mask_words

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Writes the allowed next tokens into row (int32 [mask_words], C-contiguous)."""
        assert row.dtype == np.int32 and row.shape == (self.mask_words,) and row.flags.c_contiguous, row
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the first, the grammar would accept from here (nothing changes)."""
        return self._matcher.validate_tokens(tokens) if tokens else 0

    def masks_along(self, tokens: list[int], out: np.ndarray) -> None:
        """The allowed next tokens here and after each of `tokens` (which the grammar must accept: see
        `valid_prefix`) into out (int32 [len(tokens) + 1, mask_words]); the matcher ends where it started."""
        self.fill_bitmask(out[0])
        for j, token in enumerate(tokens):
            if not self._matcher.consume_token(token):
                raise ValueError(f"token {token} is not valid here: {self.error}")
            self.fill_bitmask(out[j + 1])
        if tokens:
            self._matcher.rollback(len(tokens))

    def accept(self, token: int) -> bool:
        """Advances past `token`; False if the grammar does not allow it (the matcher then stays in error)."""
        return self._matcher.consume_token(token)

    @property
    def is_terminated(self) -> bool:
        """Nothing more can follow (the output is complete)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


def _grammar_text(params: StructuredOutputsParams, field: str, whitespace: str, additional_properties: bool) -> str:
    """`whitespace`: none, bounded (JSON_WHITESPACE) or any. A schema's own x-guidance options win."""
    import llguidance
    whitespace = {"none": {"whitespace_flexible": False},
                  "bounded": {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE},
                  "any": {"whitespace_flexible": True}}[whitespace]
    try:
        if params.json is not None:
            schema = params.json if additional_properties else closed_objects(params.json)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=whitespace)
        if params.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=whitespace)
        if params.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if params.choice is not None:
            return llguidance.grammar_from("choice", params.choice)
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        raise InvalidStructuredOutput(field, str(exc)) from None


def closed_objects(schema):
    """`schema` with additionalProperties false in every object schema that declares properties and says
    nothing about others. Members of an allOf are left open: each declares only part of the keys."""
    def close(node, in_all_of=False):
        if isinstance(node, list):
            return [close(item, in_all_of) for item in node]
        if not isinstance(node, dict):
            return node
        out = {key: close(value, key == "allOf") if key not in ("properties", "patternProperties", "$defs",
                                                               "definitions") else
               {name: close(sub) for name, sub in value.items()} if isinstance(value, dict) else value
               for key, value in node.items()}
        if (not in_all_of and ("properties" in node or "patternProperties" in node)
                and "additionalProperties" not in node and "unevaluatedProperties" not in node):
            out["additionalProperties"] = False
        return out

    return close(schema)
