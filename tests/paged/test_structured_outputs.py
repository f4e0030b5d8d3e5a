"""Structured outputs in the engine: constraints validated up front, masks exact, outputs always matching."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from paged import LLM, InvalidStructuredOutput, SamplingParams, StructuredOutputsParams
from paged.sampler import apply_token_mask

# Varied, bounded schemas: with random weights an unbounded string runs until max_tokens.
SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
     "properties": {"id": {"type": "integer", "minimum": 3, "maximum": 70},
                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
                    "note": {"type": "string", "maxLength": 6}}},
    {"type": "object", "additionalProperties": False, "required": ["inner", "ok"],
     "properties": {"inner": {"type": "object", "additionalProperties": False, "required": ["x"],
                              "properties": {"x": {"type": "number", "minimum": -2.5, "maximum": 4},
                                             "y": {"type": "boolean"}}},
                    "ok": {"type": "boolean"}}},
    {"type": "array", "minItems": 2, "maxItems": 4,
     "items": {"type": "object", "additionalProperties": False, "required": ["k"],
               "properties": {"k": {"type": "string", "minLength": 1, "maxLength": 4}}}},
]


@pytest.fixture(scope="module")
def compact_llm(tiny_model_dir):
    return LLM(tiny_model_dir, block_size=8, max_num_seqs=16, max_num_batched_tokens=128, max_model_len=512,
               structured_outputs_disable_any_whitespace=True, show_progress=False)


def _texts(outputs):
    return [c.text for o in outputs for c in o.outputs]


@pytest.mark.parametrize("kwargs, field", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": [1, 2]}, "structured_outputs.json"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 3]}, "structured_outputs.choice"),
    ({"regex": ""}, "structured_outputs.regex"),
])
def test_malformed_constraints_name_their_field(kwargs, field):
    with pytest.raises(InvalidStructuredOutput) as caught:
        StructuredOutputsParams(**kwargs)
    assert caught.value.field == field and isinstance(caught.value, ValueError)


@pytest.mark.parametrize("constraint, field", [
    ({"regex": "[a-"}, "structured_outputs.regex"),
    ({"json": {"type": "no-such-type"}}, "structured_outputs.json"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
])
def test_constraints_that_do_not_compile_fail_before_anything_runs(tiny_llm, constraint, field):
    engine = tiny_llm.engine
    with pytest.raises(ValueError) as caught:
        tiny_llm.generate(["Hello", "world"], [SamplingParams(max_tokens=4),
                                               SamplingParams(max_tokens=4, structured_outputs=constraint)])
    assert field in str(caught.value)
    assert not engine.has_unfinished_requests()
    out = tiny_llm.generate("Hello", SamplingParams(max_tokens=4, structured_outputs={"regex": "[0-9]+"}))
    assert re.fullmatch("[0-9]+", out[0].outputs[0].text)


def test_token_mask_matches_numpy_unpacking():
    rng = np.random.default_rng(0)
    for vocab in (37, 64, 100):
        words = rng.integers(-2**31, 2**31, size=(5, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
        logits = rng.normal(size=(5, vocab)).astype(np.float32)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little").reshape(5, -1)[:, :vocab].astype(bool)
        want = np.where(bits, logits, -np.inf)
        np.testing.assert_array_equal(np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(words))), want)
    # Words covering fewer ids than the vocabulary: the rest are disallowed.
    got = np.asarray(apply_token_mask(jnp.zeros((1, 40)), jnp.full((1, 1), -1, jnp.int32)))
    assert np.isfinite(got[0, :32]).all() and np.isneginf(got[0, 32:]).all()


def test_first_mask_allows_exactly_the_tokens_that_start_a_choice(tiny_llm):
    """Against the tokenizer's own strings: a token may come first iff its text is a prefix of a choice (or
    a choice followed by nothing, i.e. the token is the whole choice)."""
    engine = tiny_llm.engine
    choices = ["Hello world", "Paged"]
    matcher = engine.grammars.matcher(StructuredOutputsParams(choice=choices))
    row = np.zeros(matcher.mask_words, np.int32)
    matcher.fill_bitmask(row)
    allowed = np.unpackbits(row.view(np.uint8), bitorder="little").astype(bool)
    tokenizer = engine.tokenizer
    specials = set(tokenizer.all_special_ids)
    for token in range(len(tokenizer)):
        if token in specials:
            continue
        text = tokenizer.decode([token])
        expected = bool(text) and any(choice.startswith(text) for choice in choices)
        assert allowed[token] == expected, (token, text)
    assert not allowed[len(tokenizer):].any()


def test_json_schemas_always_validate(compact_llm):
    prompts = ["Hello world", "The quick brown fox", "Paged attention", "JAX compiles"]
    for schema in SCHEMAS:
        params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=400,
                                 structured_outputs=StructuredOutputsParams(json=schema)) for seed in range(8)]
        outputs = compact_llm.generate(prompts * 2, params, use_tqdm=False)
        for output in outputs:
            completion = output.outputs[0]
            assert completion.finish_reason == "stop", completion
            jsonschema.validate(json.loads(completion.text), schema)


def test_flexible_whitespace_json_still_validates(tiny_llm):
    schema = SCHEMAS[0]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=200,
                             structured_outputs=StructuredOutputsParams(json=schema)) for seed in range(6)]
    outputs = tiny_llm.generate(["Hello world"] * 6, params, use_tqdm=False)
    finished = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert len(finished) >= 3  # random weights may wander in whitespace until max_tokens
    assert any(re.search(r"\s", c.text) for c in finished)  # whitespace is allowed by default
    for completion in finished:
        jsonschema.validate(json.loads(completion.text), schema)


def test_regex_choice_json_object_and_grammar_outputs_match(compact_llm):
    regex = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    choices = ["yes", "no", 'naïve "quote"', "a|b"]
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'
    cases = [({"regex": regex}, lambda t: re.fullmatch(regex, t)),
             ({"choice": choices}, lambda t: t in choices),
             ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
             ({"grammar": grammar}, lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t))]
    for constraint, check in cases:
        params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=300, structured_outputs=constraint)
                  for seed in range(8)]
        for completion in (o.outputs[0] for o in compact_llm.generate(["Hello"] * 8, params, use_tqdm=False)):
            if constraint.get("json_object") and completion.finish_reason == "length":
                continue  # any JSON object is unbounded: random weights can nest past max_tokens
            assert completion.finish_reason == "stop" and check(completion.text), (constraint, completion.text)


def test_unconstrained_greedy_rows_are_unchanged_by_constrained_neighbours(tiny_model_dir):
    llm = LLM(tiny_model_dir, block_size=8, max_num_seqs=16, max_num_batched_tokens=128, max_model_len=256,
              show_progress=False)
    prompts = ["Hello world", "The quick brown fox", "Paged attention keeps", "JAX compiles the step"]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompts, plain, use_tqdm=False)
    constrained = SamplingParams(temperature=1.0, seed=5, max_tokens=40,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMAS[0]))
    mixed = llm.generate(prompts + prompts, [plain] * 4 + [constrained] * 4, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]


def _run(tiny_model_dir, params, prompts, **options):
    llm = LLM(tiny_model_dir, block_size=8, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
              structured_outputs_disable_any_whitespace=True, show_progress=False, **options)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(c.text, c.token_ids, c.finish_reason) for o in outputs for c in o.outputs], llm.engine


@pytest.mark.parametrize("options", [dict(preemption_mode="recompute"), dict(preemption_mode="swap"),
                                     dict(async_scheduling=False)])
def test_constrained_sampling_survives_preemption_forks_and_sync_scheduling(tiny_model_dir, options):
    """n=2 samples with logprobs, min_tokens and a logit_bias: the same seeded outputs with a pool small enough
    to preempt (or without async scheduling) as with room to spare, every one valid."""
    schema = SCHEMAS[2]
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=100, logprobs=2, min_tokens=3,
                            logit_bias={5: 3.0}, structured_outputs=StructuredOutputsParams(json=schema))
    prompts = [f"Paged attention keeps the cache {i}" for i in range(6)]
    want, _ = _run(tiny_model_dir, params, prompts)
    small = {"num_kv_blocks": 18} if "preemption_mode" in options else {}
    got, engine = _run(tiny_model_dir, params, prompts, **small, **options)
    assert got == want
    if small:
        assert engine.num_preemptions > 0
    for text, _, reason in got:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), schema)


def test_logprobs_of_a_constrained_row_cover_only_allowed_tokens(tiny_llm):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5,
                            structured_outputs=StructuredOutputsParams(choice=["Hello world", "Paged"]))
    completion = tiny_llm.generate("The quick", params, use_tqdm=False)[0].outputs[0]
    assert completion.text in ("Hello world", "Paged")
    first = completion.logprobs[0]
    finite = {t for t, lp in first.items() if np.isfinite(lp.logprob)}
    assert finite and all("Hello world".startswith(first[t].decoded_token) or
                          "Paged".startswith(first[t].decoded_token) for t in finite)
    assert sum(np.exp(lp.logprob) for lp in first.values() if np.isfinite(lp.logprob)) <= 1 + 1e-5


def test_grammars_are_compiled_once(tiny_llm):
    grammars = tiny_llm.engine.grammars
    before = grammars.num_compiled
    schema = {"type": "object", "properties": {"only_here": {"type": "integer"}}, "required": ["only_here"]}
    for _ in range(3):
        tiny_llm.generate("Hello", SamplingParams(max_tokens=30, structured_outputs={"json": schema}),
                          use_tqdm=False)
    assert grammars.num_compiled == before + 1


def test_the_grammar_cache_is_bounded_by_its_specs_bytes(tiny_llm, monkeypatch):
    import paged.grammar
    monkeypatch.setattr(paged.grammar, "CACHE_SPEC_BYTES", 12_000)
    grammars = paged.grammar.GrammarCompiler(tiny_llm.get_tokenizer(), tiny_llm.engine.model_config.vocab_size, (1,))
    specs = [StructuredOutputsParams(regex="(" + "|".join(f"w{i}x{j}" for j in range(800)) + ")") for i in range(6)]
    assert all(4_000 < len(s.regex) < 6_000 for s in specs)
    for spec in specs:
        grammars.compile(spec)
        assert grammars.cache_spec_bytes <= 12_000 and len(grammars._cache) <= 2
    compiled = grammars.num_compiled
    grammars.compile(specs[-1])  # the newest is kept: a hit
    grammars.compile(specs[0])  # the oldest was dropped: compiled again
    assert grammars.num_compiled == compiled + 1
    huge = StructuredOutputsParams(regex="(" + "|".join(f"h{j}" for j in range(5000)) + ")")
    grammars.compile(huge)  # larger than the whole budget: served, never cached
    assert grammars.cache_spec_bytes <= 12_000


def test_constraints_with_prefix_caching_and_stop_strings(tiny_model_dir):
    llm = LLM(tiny_model_dir, block_size=8, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
              enable_prefix_caching=True, show_progress=False)
    prompt = "Paged attention keeps the key-value cache in fixed-size blocks, like pages"
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(regex=r"([a-z]{1,5} ){3,6}END"))
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    again = llm.generate(prompt, params, use_tqdm=False)[0]  # served from the prefix cache this time
    assert again.num_cached_tokens > 0
    assert again.outputs[0].text == first.outputs[0].text
    assert re.fullmatch(r"([a-z]{1,5} ){3,6}END", first.outputs[0].text)
    # A stop string cuts the constrained output where it appears, as it would any other.
    stopped = llm.generate(prompt, SamplingParams(temperature=1.0, seed=4, max_tokens=60, stop=" ",
                                                  structured_outputs=params.structured_outputs), use_tqdm=False)[0]
    completion = stopped.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == " "
    assert completion.text == first.outputs[0].text.split(" ")[0]


BOUNDED = {"type": "object", "required": ["a", "b"],
           "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}}}
OPEN = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}


def _blank_runs(text: str) -> list[str]:
    """Runs of whitespace between JSON tokens (strings blanked out first)."""
    return re.findall(r"\s+", re.sub(r'"(?:[^"\\]|\\.)*"', '""', text))


def _json_runs(llm, schema, seeds: int = 12, max_tokens: int = 60):
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                             structured_outputs=StructuredOutputsParams(json=schema)) for seed in range(seeds)]
    return [o.outputs[0] for o in llm.generate(["Hello world"] * seeds, params, use_tqdm=False)]


def test_json_whitespace_is_bounded_by_default(tiny_llm, tiny_model_dir):
    """Default: one space, or a newline and an indent, between tokens; every output finishes. With
    structured_outputs_any_whitespace the same random model runs into blanks."""
    from paged.grammar import JSON_WHITESPACE
    outputs = _json_runs(tiny_llm, BOUNDED)
    assert all(c.finish_reason == "stop" for c in outputs), [c.text for c in outputs]
    runs = [run for c in outputs for run in _blank_runs(c.text)]
    assert runs  # whitespace is still allowed
    assert all(re.fullmatch(JSON_WHITESPACE, run) for run in runs), runs
    for completion in outputs:
        jsonschema.validate(json.loads(completion.text), BOUNDED)
    free = LLM(tiny_model_dir, block_size=8, max_num_seqs=16, max_num_batched_tokens=128, max_model_len=512,
               structured_outputs_any_whitespace=True, show_progress=False)
    loose = _json_runs(free, BOUNDED)
    assert any(c.finish_reason == "length" or not all(re.fullmatch(JSON_WHITESPACE, r) for r in _blank_runs(c.text))
               for c in loose)


def test_objects_hold_only_declared_keys_by_default(tiny_llm, tiny_model_dir):
    """A schema without additionalProperties (pydantic's, instructor's) generates no keys it does not declare,
    as vLLM's default backend; structured_outputs_additional_properties reads it as JSON Schema does."""
    for completion in _json_runs(tiny_llm, OPEN, max_tokens=40):
        assert completion.finish_reason == "stop"
        assert set(json.loads(completion.text)) <= {"a"}, completion.text
    open_llm = LLM(tiny_model_dir, block_size=8, max_num_seqs=16, max_num_batched_tokens=128, max_model_len=512,
                   structured_outputs_additional_properties=True, structured_outputs_disable_any_whitespace=True,
                   show_progress=False)
    texts = [c.text for c in _json_runs(open_llm, OPEN, max_tokens=40)]
    # The flag restores JSON Schema's open objects: random weights start keys of their own (and run on in them).
    assert any(t.startswith('{"') and not t.startswith('{"a"') for t in texts), texts


def test_closing_objects_leaves_explicit_choices_and_all_of_parts_alone():
    from paged.grammar import closed_objects
    schema = {"type": "object", "properties": {"inner": {"type": "object", "properties": {"x": {}}},
                                               "free": {"type": "object", "properties": {}, "additionalProperties": True}},
              "allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}],
              "$defs": {"D": {"type": "object", "properties": {"d": {}}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert closed["properties"]["free"]["additionalProperties"] is True
    assert all("additionalProperties" not in part for part in closed["allOf"])
    assert closed["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's schema is not changed


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_constraint_can_start_after_a_marker(tmp_path, async_scheduling):
    """structured_outputs_after: the output is free until it holds the marker, then the grammar shapes the
    rest (a reasoning model's thinking, then its answer). The scripted model writes <think>Let</think> and
    then wants "The answer is 4": the grammar turns that into an integer."""
    from paged import LLM
    from tests.serving.scripted_model import create_scripted_llama
    llm = LLM(create_scripted_llama(str(tmp_path), "<think>Let</think>The answer is 4"), max_model_len=128,
              show_progress=False, async_scheduling=async_scheduling)
    messages = [{"role": "user", "content": "2 + 2?"}]
    digit = {"json": {"type": "integer", "minimum": 0, "maximum": 9}}
    free = llm.chat(messages, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert free.text == "<think>Let</think>The answer is 4"
    after = llm.chat(messages, SamplingParams(temperature=0, max_tokens=30, structured_outputs=digit,
                                              structured_outputs_after="</think>"), use_tqdm=False)[0].outputs[0]
    thinking, _, answer = after.text.partition("</think>")
    assert thinking == "<think>Let" and 0 <= json.loads(answer) <= 9 and after.finish_reason == "stop"
    whole = llm.chat(messages, SamplingParams(temperature=0, max_tokens=30, structured_outputs=digit),
                     use_tqdm=False)[0].outputs[0]
    assert "<think>" not in whole.text and 0 <= json.loads(whole.text) <= 9  # from the first token
    with pytest.raises(ValueError, match="structured_outputs_after"):
        SamplingParams(structured_outputs_after="")
