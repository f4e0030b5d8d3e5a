"""Incremental detokenization and stop-string detection.

Decoding the whole output every step costs O(n^2) over a generation; instead each step decodes a short
window: the tokens since the last emitted boundary, minus the part already turned into text. A window
that ends in U+FFFD (an unfinished UTF-8 sequence) waits for the next token.
"""

from __future__ import annotations

# Prompt tokens kept as left context so the first output token decodes with the right leading space.
_CONTEXT_TOKENS = 5


def _backend_decode(tokenizer):
    """The `tokenizers` library's own decode, when the transformers tokenizer wraps it unchanged.

    transformers' `decode` first converts its input element by element (to accept tensors and arrays) and
    then calls this; for a few tokens per step that wrapper costs most of the decode (about 3% of a CPU
    benchmark run). Subclasses that override `_decode` keep the wrapper.
    """
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if isinstance(tokenizer, TokenizersBackend) and type(tokenizer)._decode is TokenizersBackend._decode:
        return tokenizer.backend_tokenizer.decode
    return None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""
        self._fast_decode = _backend_decode(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Appends one token; returns the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back (an unfinished UTF-8 sequence at the end); called when the output ends."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        delta = full_text[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta


def find_stop_string(text: str, delta_len: int, stops: list[str]) -> tuple[str, int] | None:
    """Finds the earliest stop string that the last `delta_len` characters completed.

    Returns (stop, index where it starts) or None. Only the tail can hold a new match, so the search
    starts `len(stop) - 1` characters before the delta.
    """
    best = None
    for stop in stops:
        start = max(0, len(text) - delta_len - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop, index)
    return best
