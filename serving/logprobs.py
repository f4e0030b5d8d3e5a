"""Token logprobs in the shapes OpenAI's API uses (completions' parallel lists, chat's list of entries) and
vLLM's `prompt_logprobs`.

A token a structured output's grammar forbids has logprob -inf, which strict JSON cannot carry: every value
goes out clamped to -9999.0, as vLLM sends it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

LOWEST_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict | None], k: int, offset: int,
                        decode: Callable[[int], str]) -> dict:
    """Completions' {tokens, token_logprobs, top_logprobs, text_offset} of `token_ids`, each with its entry
    ({token id: Logprob}; None for a prompt's first token, which nothing predicts: its logprob and top
    logprobs are null, as vLLM's echo gives them). `offset`: the first token's position in the choice's text."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        if entry is None:
            text, logprob, tops = decode(token), None, None
        else:
            chosen = entry[token]
            text, logprob = chosen.decoded_token or "", finite(chosen.logprob)
            # Keys are decoded strings; byte pieces can decode alike, so the likelier one keeps the key.
            tops = {}
            for tid, lp in sorted(entry.items(), key=lambda item: -item[1].logprob):
                if lp.rank is not None and (lp.rank <= k or tid == token):
                    tops.setdefault(lp.decoded_token or "", finite(lp.logprob))
        tokens.append(text)
        token_logprobs.append(logprob)
        top.append(tops)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def joined(first: dict, second: dict) -> dict:
    """Two completions logprobs objects, one after the other (an echoed prompt, then the generated tokens)."""
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(completion, start: int, end: int, k: int) -> dict:
    content = []
    for j in range(start, end):
        token = completion.token_ids[j]
        entry = completion.logprobs[j]
        item = lambda lp: {"token": lp.decoded_token or "", "logprob": finite(lp.logprob),
                           "bytes": list((lp.decoded_token or "").encode())}
        tops = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)
        content.append({**item(entry[token]), "top_logprobs": [item(lp) for lp in tops]})
    return {"content": content}


def prompt_logprobs_json(prompt_logprobs: list[dict | None] | None) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: null for the first token, then {token id: {logprob, rank, decoded_token}}
    holding the prompt's token and the top k."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(tid): {"logprob": finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in entry.items()}
            for entry in prompt_logprobs]
