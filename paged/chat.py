"""Prompts to token ids, one way for `LLM`, the engine and the server: plain text and chat templates."""

from __future__ import annotations

from typing import Any


def text_token_ids(tokenizer, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`. Raises ValueError for text the tokenizer refuses, e.g. one holding a lone UTF-16
    surrogate (the caller's input, not a bug)."""
    try:
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=add_special_tokens)]
    except Exception as exc:  # noqa: BLE001 - the tokenizer's refusal of the caller's text
        raise ValueError(f"the prompt could not be tokenized: {type(exc).__name__}: {exc}") from None


def chat_prompt_token_ids(tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                          chat_template: str | None = None, max_chars: int | None = None,
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of `messages` rendered by `chat_template` (default: the tokenizer's own).

    The template is rendered to text first and tokenized without adding special tokens (what transformers'
    `tokenize=True` does), so a rendering longer than `max_chars` is refused before it is tokenized. `tools`
    (OpenAI's function tools) reach the template as transformers passes them.
    Raises ValueError for anything the template or the tokenizer refuses (the caller's input, not a bug).
    """
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, tokenize=False, tools=tools)
    except Exception as exc:  # noqa: BLE001 - template errors come from the messages
        raise ValueError(f"could not apply the chat template: {type(exc).__name__}: {exc}") from None
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(f"the chat template rendered {len(text)} characters, more than the limit of {max_chars}")
    return text_token_ids(tokenizer, text, add_special_tokens=False)
