"""Token logprobs in the two shapes OpenAI's API uses: completions' parallel lists, chat's list of entries."""

from __future__ import annotations


def completion_logprobs(completion, start: int, end: int, k: int, offset: int) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for j in range(start, end):
        token = completion.token_ids[j]
        entry = completion.logprobs[j]
        chosen = entry[token]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        # Keys are decoded strings; byte pieces can decode alike, so the likelier one keeps the key.
        tops: dict[str, float] = {}
        for tid, lp in sorted(entry.items(), key=lambda item: -item[1].logprob):
            if lp.rank is not None and (lp.rank <= k or tid == token):
                tops.setdefault(lp.decoded_token or "", lp.logprob)
        top.append(tops)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(completion, start: int, end: int, k: int) -> dict:
    content = []
    for j in range(start, end):
        token = completion.token_ids[j]
        entry = completion.logprobs[j]
        item = lambda lp: {"token": lp.decoded_token or "", "logprob": lp.logprob,
                           "bytes": list((lp.decoded_token or "").encode())}
        tops = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)
        content.append({**item(entry[token]), "top_logprobs": [item(lp) for lp in tops]})
    return {"content": content}
