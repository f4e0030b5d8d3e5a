"""The chat template, applied one way for `LLM.chat` and the server's chat and tokenize routes."""

from __future__ import annotations

from typing import Any


def chat_prompt_token_ids(tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                          chat_template: str | None = None) -> list[int]:
    """Token ids of `messages` rendered by `chat_template` (default: the tokenizer's own).

    Raises ValueError for anything the template or the tokenizer refuses (the caller's input, not a bug).
    """
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            chat_template=chat_template, tokenize=True, return_dict=False)
    except Exception as exc:  # noqa: BLE001 - template and tokenizer errors come from the messages
        raise ValueError(f"could not apply the chat template: {type(exc).__name__}: {exc}") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]
