"""Speculative decoding in the engine: greedy outputs equal the same engine without it, whatever the
proposals (an oracle that knows the answer and then errs, the n-gram proposer on copied text)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paged import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 400, size=int(rng.integers(4, 30))).tolist() for _ in range(count)]


def _tokens(llm, prompts, params=GREEDY) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _oracle(answers: dict[tuple, list[int]], wrong_every: int):
    """A proposer that knows each prompt's greedy continuation: it proposes the next tokens of it, with the
    last one replaced by a wrong token on every `wrong_every`-th proposal (so some are accepted in full, some
    in part)."""
    calls = [0]

    def propose(request, limit):
        answer = answers[tuple(request.prompt_token_ids)]
        done = request.num_tokens - request.num_prompt_tokens
        drafts = answer[done:done + min(limit, 3)]
        calls[0] += 1
        if drafts and calls[0] % wrong_every == 0:
            drafts = [*drafts[:-1], (drafts[-1] + 1) % 400]
        return drafts
    return propose


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    prompts = _prompts(6)
    return prompts, _tokens(LLM(tiny_model_dir, show_progress=False), prompts)


@pytest.mark.parametrize("wrong_every", [1, 2, 1000], ids=["always-one-wrong", "every-other", "all-right"])
def test_greedy_outputs_do_not_change_whatever_is_accepted(tiny_model_dir, reference, wrong_every):
    prompts, want = reference
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=NGRAM)
    llm.engine.scheduler.propose = _oracle(dict(zip(map(tuple, prompts), want)), wrong_every)
    assert _tokens(llm, prompts) == want
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0
    if wrong_every == 1000:  # every proposal right: each row takes 4 tokens a step
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[-1]


def test_preempted_rows_drop_their_proposals(tiny_model_dir, reference):
    """A pool too small for every row at once: rows are preempted (recompute) with proposals appended."""
    prompts, want = reference
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=NGRAM, num_kv_blocks=12, block_size=8,
              max_model_len=64)
    llm.engine.scheduler.propose = _oracle(dict(zip(map(tuple, prompts), want)), 2)
    assert _tokens(llm, prompts) == want
    assert llm.engine.num_preemptions > 0


def test_stops_and_length_end_inside_accepted_tokens(tiny_model_dir, reference):
    prompts, want = reference
    stop = want[0][5]
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop])
    plain = LLM(tiny_model_dir, show_progress=False).generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             use_tqdm=False)
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=NGRAM)
    llm.engine.scheduler.propose = _oracle(dict(zip(map(tuple, prompts), want)), 1000)
    fast = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(plain, fast):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert (b.outputs[0].finish_reason, b.outputs[0].stop_reason) == (a.outputs[0].finish_reason,
                                                                         a.outputs[0].stop_reason)
        assert len(b.outputs[0].token_ids) <= 10


@pytest.mark.parametrize("filters", [{}, {"top_k": 5}, {"top_p": 0.7, "min_p": 0.05}], ids=["plain", "top-k", "top-p-min-p"])
def test_seeded_samples_and_logprobs_do_not_change_whatever_is_accepted(tiny_model_dir, filters):
    """Sampled rows speculate too: each verified position draws with the key it has without proposals, so a
    seeded request gets the same tokens and logprobs whatever is proposed (here its own continuation, then
    wrong every other time), n > 1 and greedy rows beside it."""
    prompts = _prompts(6, seed=2)
    mixed = [SamplingParams(temperature=0.9, seed=3 + i, max_tokens=16, ignore_eos=True, logprobs=2,
                            n=2 if i == 1 else 1, **filters) if i % 3 else GREEDY for i in range(6)]
    plain = LLM(tiny_model_dir, show_progress=False).generate([{"prompt_token_ids": p} for p in prompts], mixed,
                                                             use_tqdm=False)
    # Each sample's own continuation (the proposer sees children by their seeds' streams: index 0's here).
    answers = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, plain)}
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=NGRAM)
    llm.engine.scheduler.propose = _oracle(answers, 2)
    fast = llm.generate([{"prompt_token_ids": p} for p in prompts], mixed, use_tqdm=False)
    for a, b in zip(plain, fast):
        assert [o.token_ids for o in b.outputs] == [o.token_ids for o in a.outputs]
        for x, y in zip(a.outputs, b.outputs):
            if x.logprobs is None:
                continue
            assert len(y.logprobs) == len(y.token_ids)
            # (the steps' shapes differ with proposals in them: float32 sums in another order)
            assert y.cumulative_logprob == pytest.approx(x.cumulative_logprob, abs=1e-4)
            for want, got in zip(x.logprobs, y.logprobs):
                assert list(got) == list(want)
                assert [v.logprob for v in got.values()] == pytest.approx([v.logprob for v in want.values()],
                                                                          abs=1e-4)
    stats = llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
          "properties": {"id": {"type": "integer", "minimum": 3, "maximum": 70},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}}


def test_grammar_penalty_and_bias_rows_speculate_without_changing_their_tokens(tiny_model_dir):
    """Rows whose logits the request changes: each verified position gets its own grammar mask (after the
    proposals before it), penalty counts (the proposals counted as output) and biases. Greedy and seeded,
    proposals their own continuation then wrong every other time; nothing compiles after precompile()."""
    from paged import StructuredOutputsParams
    prompts = _prompts(6, seed=9)
    json_schema = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                       frequency_penalty=0.4, presence_penalty=0.2),
        SamplingParams(temperature=0.8, seed=11, max_tokens=20, ignore_eos=True, frequency_penalty=0.5,
                       logit_bias={7: 3.0, 9: -100.0}, logprobs=1),
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=json_schema),
        SamplingParams(temperature=0.7, seed=5, max_tokens=40, structured_outputs=json_schema, logprobs=1),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logit_bias={11: 5.0}),
        SamplingParams(temperature=0.9, seed=2, max_tokens=20, structured_outputs=StructuredOutputsParams(
            regex="(ab|cd)+x?")),
    ]
    options = dict(show_progress=False, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256,
                   structured_outputs_disable_any_whitespace=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    plain = LLM(tiny_model_dir, **options).generate(requests, params, use_tqdm=False)
    answers = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, plain)}
    llm = LLM(tiny_model_dir, speculative_config=NGRAM, **options)
    llm.engine.precompile()
    compiled = llm.engine.num_compilations
    llm.engine.scheduler.propose = _oracle(answers, 2)
    fast = llm.generate(requests, params, use_tqdm=False)
    assert llm.engine.num_compilations == compiled
    for a, b in zip(plain, fast):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].text == a.outputs[0].text
        if a.outputs[0].logprobs is not None:
            assert [list(e) for e in b.outputs[0].logprobs] == [list(e) for e in a.outputs[0].logprobs]
            assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob, abs=1e-4)
    json.loads(fast[2].outputs[0].text)
    stats = llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_proposals_the_grammar_rejects_are_not_verified(tiny_model_dir):
    """A proposer that proposes the grammar's forbidden tokens: they are cut before verification, so the row
    computes only its own next token and the output is the one without speculation."""
    from paged import StructuredOutputsParams
    prompt = _prompts(1, seed=10)[0]
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    want = LLM(tiny_model_dir, show_progress=False).generate([{"prompt_token_ids": prompt}], params,
                                                             use_tqdm=False)[0].outputs[0].text
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=NGRAM)
    eos = llm.engine.model_config.eos_token_ids[0]
    llm.engine.scheduler.propose = lambda request, limit: [eos + 1, eos + 2][:limit]
    assert llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].text == want
    assert llm.engine.spec_stats.num_draft_tokens == 0


def test_sampled_tokens_follow_the_target_distribution_whatever_is_proposed(tiny_model_dir):
    """Temperature 1 over each position's top 3: the joint distribution of output tokens 2 and 3 (the first
    verified step: one proposal, then the bonus token) against the exact one computed from the target's own
    logprobs, with a proposer that always proposes the least likely of the three (a wrong draft
    distribution). Accepting the proposal whenever it is in the top 3, for one, would put mass 1/3 + on it."""
    prompt = _prompts(1, seed=5)[0]
    plain = LLM(tiny_model_dir, show_progress=False)

    def top3(prefix):  # the next token's three most likely tokens and their probabilities at top_k=3
        out = plain.generate([{"prompt_token_ids": prefix}], SamplingParams(max_tokens=1, temperature=0, logprobs=3),
                             use_tqdm=False)[0].outputs[0].logprobs[0]
        best = sorted(out.items(), key=lambda item: item[1].rank)[:3]
        logp = np.array([v.logprob for _, v in best], np.float64)
        return [t for t, _ in best], np.exp(logp) / np.exp(logp).sum()

    first_tokens, _ = top3(prompt)
    exact, least_likely = {}, {}
    for t1 in first_tokens:
        seconds, p2 = top3(prompt + [t1])
        least_likely[t1] = seconds[2]
        for t2, q2 in zip(seconds, p2):
            thirds, p3 = top3(prompt + [t1, t2])
            for t3, q3 in zip(thirds, p3):
                exact[(t1, t2, t3)] = q2 * q3  # given t1

    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=NGRAM)
    # (with async scheduling the first token may still be in flight: then the first one's least likely)
    wrong = lambda request: least_likely.get(request.token_ids[-1], least_likely[first_tokens[0]])
    llm.engine.scheduler.propose = lambda request, limit: [wrong(request)][:limit]
    n = 3000
    params = [SamplingParams(temperature=1.0, top_k=3, seed=seed, max_tokens=3, ignore_eos=True)
              for seed in range(n)]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    counts: dict[tuple, int] = {}
    for output in outputs:
        key = tuple(output.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    stats = llm.engine.spec_stats
    assert stats.num_drafts == n and 0 < stats.num_accepted_tokens < n
    # Each first token's samples against the exact distribution of the two after it.
    for t1 in first_tokens:
        mine = {k: c for k, c in counts.items() if k[0] == t1}
        total = sum(mine.values())
        cells = {k for k in exact if k[0] == t1} | set(mine)
        tv = 0.5 * sum(abs(mine.get(k, 0) / total - exact.get(k, 0.0)) for k in cells)
        assert tv < 3 / np.sqrt(total), (t1, tv, total)


def test_the_ngram_proposer_speeds_up_copying_without_changing_it(tiny_model_dir):
    """A prompt that repeats itself: the model's continuation repeats it too often enough for prompt lookup to
    be accepted; nothing compiles after precompile()."""
    rng = np.random.default_rng(1)
    phrase = rng.integers(5, 400, 6).tolist()
    prompts = [phrase * 6, _prompts(1, seed=4)[0]]
    want = _tokens(LLM(tiny_model_dir, show_progress=False), prompts)
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=NGRAM)
    llm.engine.precompile()
    compiled = llm.engine.num_compilations
    assert _tokens(llm, prompts) == want
    assert llm.engine.num_compilations == compiled
    assert llm.engine.spec_stats.num_drafts > 0


def test_methods_not_implemented_are_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="method 'mtp' is not supported; supported: ngram, draft_model, eagle, eagle3"):
        LLM(tiny_model_dir, show_progress=False,
            speculative_config={"method": "mtp", "model": tiny_model_dir, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="prompt_lookup_min=3 must be <= prompt_lookup_max=2"):
        LLM(tiny_model_dir, show_progress=False, speculative_config='{"method": "ngram", "num_speculative_tokens": 2, '
                                                                   '"prompt_lookup_min": 3, "prompt_lookup_max": 2}')


TP_SCRIPT = """
import json, sys
from paged import LLM, SamplingParams
model, prompts, answers = json.loads(sys.argv[1])
llm = LLM(model, tensor_parallel_size=2, show_progress=False, speculative_config={"method": "ngram",
          "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
table = {tuple(p): a for p, a in zip(prompts, answers)}
def propose(request, limit):  # right, then one wrong token every other time
    done = request.num_tokens - request.num_prompt_tokens
    drafts = table[tuple(request.prompt_token_ids)][done:done + min(limit, 3)]
    return drafts if done % 2 else [*drafts[:-1], (drafts[-1] + 1) % 400] if drafts else drafts
llm.engine.scheduler.propose = propose
outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
"""


def test_tensor_parallel_verification_keeps_the_tokens(tiny_model_dir, reference):
    import json
    import os
    import subprocess
    import sys
    prompts, want = reference
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    run = subprocess.run([sys.executable, "-c", TP_SCRIPT, json.dumps([tiny_model_dir, prompts, want])],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    assert json.loads(lines[0][len("RESULT "):]) == want


# One of each kind of difference the step has: GQA, a sliding window, fused projections, learned positions,
# soft caps and alternating windows, local rotary bases, partial interleaved rotary, MoE routing.
FAMILIES = ["llama-gqa", "mistral-window", "phi3-fused", "gpt2", "gemma2", "gemma3", "glm", "qwen3-moe"]


@pytest.mark.torch
@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_keeps_its_tokens(name, tmp_path_factory):
    """Proposals right, then wrong every other time, on each family's tiny checkpoint (sliding windows, soft
    caps, MoE routing): the tokens of the same engine without speculation."""
    pytest.importorskip("torch")
    from tests.hf_checkpoints import build_checkpoint
    model = build_checkpoint(name, str(tmp_path_factory.mktemp(name)))
    prompts = _prompts(3, seed=7)
    want = _tokens(LLM(model, show_progress=False, dtype="float32"), prompts)
    llm = LLM(model, show_progress=False, dtype="float32", speculative_config=NGRAM)
    llm.engine.scheduler.propose = _oracle(dict(zip(map(tuple, prompts), want)), 2)
    assert _tokens(llm, prompts) == want
    assert 0 < llm.engine.spec_stats.num_accepted_tokens < llm.engine.spec_stats.num_draft_tokens


def test_no_proposals_while_the_batch_is_large(tiny_model_dir, reference):
    prompts, want = reference
    config = {**NGRAM, "disable_by_batch_size": 4}
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=config)
    calls = []
    oracle = _oracle(dict(zip(map(tuple, prompts), want)), 1000)
    llm.engine.scheduler.propose = lambda request, limit: calls.append(len(llm.engine.scheduler.running)) or \
        oracle(request, limit)
    lengths = [4, 6, 8, 24, 24, 24]  # three finish early: then three run, and they speculate
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    assert _tokens(llm, prompts, params) == [w[:n] for w, n in zip(want, lengths)]
    assert calls and max(calls) < 4


def test_a_batch_too_large_to_speculate_keeps_async_scheduling(tiny_model_dir, reference):
    """While disable_by_batch_size or more requests run, no step needs reading back before the next one is
    scheduled: steps overlap as without speculation. Once fewer run, steps are read back and proposals made."""
    prompts, want = reference
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config={**NGRAM, "disable_by_batch_size": 4})
    llm.engine.scheduler.propose = _oracle(dict(zip(map(tuple, prompts), want)), 1000)
    overlapped = []
    original = llm.engine._postprocess

    def postprocess(flight):
        # Read after the next step was scheduled (overlapped), or before (read back)?
        scheduled = llm.engine._scheduled
        overlapped.append((len(flight.batch.requests), scheduled is not None and scheduled is not flight.batch))
        return original(flight)
    llm.engine._postprocess = postprocess
    lengths = [24, 24, 24, 6, 6, 6]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    assert _tokens(llm, prompts, params) == [w[:n] for w, n in zip(want, lengths)]
    assert all(after for rows, after in overlapped if rows >= 4)
    assert not all(after for rows, after in overlapped if rows < 4)
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_blocks_written_while_speculating_serve_later_prefix_hits(tiny_model_dir, reference):
    """Rejected proposals' K/V sit past the computed tokens and are written over; the blocks the prefix cache
    keeps hold only verified tokens: a later prompt that extends a speculated output hits them and continues
    as the plain engine does."""
    prompts, want = reference
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=NGRAM, block_size=8)
    llm.engine.scheduler.propose = _oracle(dict(zip(map(tuple, prompts), want)), 1)
    first = _tokens(llm, prompts)
    assert first == want
    extended = [p + w for p, w in zip(prompts, want)]
    plain = _tokens(LLM(tiny_model_dir, show_progress=False, block_size=8, enable_prefix_caching=False), extended)
    llm.engine.scheduler.propose = lambda request, limit: []
    outputs = llm.generate([{"prompt_token_ids": p} for p in extended], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == plain
    assert sum(o.num_cached_tokens for o in outputs) >= 8 * len(prompts)


def test_a_stop_string_inside_accepted_tokens_ends_the_text_there(tiny_model_dir, reference):
    prompts, want = reference
    texts = [o.outputs[0].text for o in LLM(tiny_model_dir, show_progress=False).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    stops = [text[len(text) // 2:len(text) // 2 + 2] for text in texts]
    params = [SamplingParams(temperature=0, max_tokens=24, stop=[stop]) for stop in stops]
    plain = LLM(tiny_model_dir, show_progress=False).generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             use_tqdm=False)
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=NGRAM)
    llm.engine.scheduler.propose = _oracle(dict(zip(map(tuple, prompts), want)), 1000)
    fast = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b, stop in zip(plain, fast, stops):
        assert (b.outputs[0].text, b.outputs[0].token_ids) == (a.outputs[0].text, a.outputs[0].token_ids)
        assert b.outputs[0].stop_reason == a.outputs[0].stop_reason
    assert sum(o.outputs[0].stop_reason in stops for o in fast) >= len(prompts) // 2
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_blocks_allocated_for_rejected_proposals_go_back(tiny_model_dir, reference):
    """Blocks of 4 tokens and 3 proposals: a rejected run of proposals often spilled into a block of its own,
    which is released at verification: a verified request holds the blocks of its computed tokens and the
    next one."""
    prompts, want = reference
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=NGRAM, block_size=4,
              enable_prefix_caching=False)
    llm.engine.scheduler.propose = _oracle(dict(zip(map(tuple, prompts), want)), 1)
    outputs, verify = llm.engine.outputs, llm.engine.outputs._verify_drafts
    held = []

    def checked(request, drawn):
        tokens = verify(request, drawn)
        held.append((len(request.block_ids), llm.engine.block_manager.blocks_for(request.num_computed_tokens + 1)))
        return tokens
    outputs._verify_drafts = checked
    assert _tokens(llm, prompts) == want
    assert held and all(blocks == needed for blocks, needed in held)
