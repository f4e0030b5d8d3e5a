"""What a model-based proposer (draft model, EAGLE head) proposed, recorded as the engine runs."""

from __future__ import annotations

from paged import SamplingParams


def first_proposals(llm, prompts: list[list[int]], max_tokens: int = 8) -> list[tuple[list[int], int, list[int]]]:
    """Greedy runs of `prompts`; for each request, (prompt, the first output token, the proposals made with
    it): a request's first proposals come in the step after its prompt, beside its first token."""
    draft, seen = llm.engine.draft, {}
    original = draft.begin_step

    def recording(candidates, running):
        original(candidates, running)
        for request, _ in candidates:
            if request.request_id not in seen and id(request) in draft.proposals:
                seen[request.request_id] = (list(request.token_ids), draft.proposals[id(request)])
    draft.begin_step = recording
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    finally:
        draft.begin_step = original
    assert len(seen) == len(prompts), "a request was never proposed for"
    return [(tokens[:-1], tokens[-1], proposals) for tokens, proposals in seen.values()]
