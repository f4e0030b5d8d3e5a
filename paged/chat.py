"""The chat template, applied one way for `LLM.chat` and the server's chat and tokenize routes."""

from __future__ import annotations

from typing import Any


def chat_prompt_token_ids(tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                          chat_template: str | None = None, max_chars: int | None = None) -> list[int]:
    """Token ids of `messages` rendered by `chat_template` (default: the tokenizer's own).

    The template is rendered to text first and tokenized without adding special tokens (what transformers'
    `tokenize=True` does), so a rendering longer than `max_chars` is refused before it is tokenized.
    Raises ValueError for anything the template or the tokenizer refuses (the caller's input, not a bug).
    """
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - template errors come from the messages
        raise ValueError(f"could not apply the chat template: {type(exc).__name__}: {exc}") from None
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(f"the chat template rendered {len(text)} characters, more than the limit of {max_chars}")
    try:
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    except Exception as exc:  # noqa: BLE001 - e.g. a lone surrogate in a message
        raise ValueError(f"could not tokenize the rendered chat: {type(exc).__name__}: {exc}") from None
