"""The public API: prompt forms, stopping rules, seeds, chat, and clear errors on bad input."""

from __future__ import annotations

import numpy as np
import pytest

from paged import LLM, RequestOutput, SamplingParams


def _greedy(llm, prompt, **kw):
    params = SamplingParams(temperature=0, ignore_eos=True, **kw)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def test_prompt_forms_and_output_order(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    prompts = ["Hello world", "The quick brown fox", "Paged attention keeps"]
    outs = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert all(isinstance(o, RequestOutput) and o.finished for o in outs)
    assert [o.prompt_token_ids for o in outs] == [tok.encode(p) for p in prompts]
    by_ids = tiny_llm.generate([{"prompt_token_ids": tok.encode(p)} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_ids] == [o.outputs[0].token_ids for o in outs]
    single = tiny_llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                               use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_incremental_text_equals_full_decode(tiny_llm):
    out = _greedy(tiny_llm, "The quick brown fox", max_tokens=40)
    assert out.text == tiny_llm.get_tokenizer().decode(out.token_ids, skip_special_tokens=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 40


def test_detokenizer_fast_path_equals_transformers_decode(tiny_llm):
    """The detokenizer calls the `tokenizers` backend directly; token by token it must build the same text as
    transformers' decode of the whole output, special tokens included or skipped."""
    from paged.detokenizer import IncrementalDetokenizer
    tokenizer = tiny_llm.get_tokenizer()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, len(tokenizer), size=200).tolist() + [tokenizer.eos_token_id or 0] * 2
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        assert detok._fast_decode is not None
        text = "".join(detok.add(t) for t in ids) + detok.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_stop_string_cuts_text_and_reports_reason(tiny_llm):
    full = _greedy(tiny_llm, "Hello world", max_tokens=40)
    # Pick a stop string that first appears in the middle of the generated text.
    text = full.text
    start = len(text) // 2
    stop = text[start:start + 3]
    first = text.find(stop)
    out = _greedy(tiny_llm, "Hello world", max_tokens=40, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:first]
    assert out.token_ids == full.token_ids[:len(out.token_ids)]
    kept = _greedy(tiny_llm, "Hello world", max_tokens=40, stop=stop, include_stop_str_in_output=True)
    assert kept.text == text[:first + len(stop)]


def test_stop_token_ids_and_eos(tiny_llm):
    full = _greedy(tiny_llm, "Hello world", max_tokens=30)
    target = full.token_ids[7]
    first = full.token_ids.index(target)
    out = _greedy(tiny_llm, "Hello world", max_tokens=30, stop_token_ids=[target])
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.token_ids == full.token_ids[:first + 1]
    # The same token as EOS stops too (stop_reason None), unless ignore_eos.
    engine = tiny_llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = (target,)
    try:
        params = SamplingParams(temperature=0, max_tokens=30)
        eos_out = tiny_llm.generate("Hello world", params, use_tqdm=False)[0].outputs[0]
        assert eos_out.finish_reason == "stop" and eos_out.stop_reason is None
        assert eos_out.token_ids == full.token_ids[:first + 1]
        # min_tokens keeps EOS out of the sample until enough tokens exist.
        params = SamplingParams(temperature=0, max_tokens=30, min_tokens=first + 3)
        min_out = tiny_llm.generate("Hello world", params, use_tqdm=False)[0].outputs[0]
        assert target not in min_out.token_ids[:first + 3]
        assert len(min_out.token_ids) >= first + 3
    finally:
        engine.eos_token_ids = saved


def test_logit_bias_and_min_tokens_rows_beside_plain_ones(tiny_llm):
    """A forcing bias, a 40-entry ban list (wider than the step's default row of 16) and min_tokens over 20
    stop ids, in one batch with an unbiased row that must come out as it does alone."""
    plain = _greedy(tiny_llm, "Hello world", max_tokens=12)
    forced = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={17: 100.0})
    avoided = sorted(set(plain.token_ids))
    banned = dict.fromkeys(avoided + list(range(300, 340 - len(avoided))), -100.0)
    avoid = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=banned)
    stops = [plain.token_ids[0]] + list(range(400, 420))
    held = SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=stops)
    unbiased = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = [o.outputs[0] for o in tiny_llm.generate(["Hello world"] * 4, [forced, avoid, held, unbiased],
                                                    use_tqdm=False)]
    assert outs[0].token_ids == [17] * 12
    assert len(banned) == 40 and not set(outs[1].token_ids) & set(banned)
    assert plain.token_ids[0] not in outs[2].token_ids[:6] and len(outs[2].token_ids) >= 6
    assert outs[3].token_ids == plain.token_ids


def test_seed_reproducible_whatever_shares_the_batch(tiny_llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=1234, ignore_eos=True)
    alone = tiny_llm.generate("Hello world", params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = ["The quick brown fox", "Hello world", "Continuous batching lets"]
    others = SamplingParams(temperature=0.9, max_tokens=35, ignore_eos=True)
    together = tiny_llm.generate(crowd, [others, params, others], use_tqdm=False)[1].outputs[0].token_ids
    assert alone == together
    different = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=4321, ignore_eos=True)
    assert tiny_llm.generate("Hello world", different, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_unseeded_runs_follow_the_engine_seed(tiny_model_dir):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = []
    for seed in (0, 0, 1):
        llm = LLM(tiny_model_dir, seed=seed, block_size=8, max_model_len=128, show_progress=False)
        runs.append([o.outputs[0].token_ids for o in llm.generate(["Hello", "world"], params, use_tqdm=False)])
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_chat_applies_the_template(tiny_llm):
    messages = [{"role": "user", "content": "Hello world"}]
    out = tiny_llm.chat(messages, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    expected_ids = tiny_llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True,
                                                                tokenize=True, return_dict=False)
    assert out.prompt_token_ids == list(expected_ids)
    assert "<|assistant|>" in out.prompt


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(seed=-1), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-4]), "stop_token_ids"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys"),
    (dict(logit_bias={"5": 1.0}), "logit_bias keys"),
    (dict(logit_bias={5: 100.5}), "logit_bias values"),
    (dict(logit_bias={5: float("nan")}), "logit_bias values"),
])
def test_invalid_sampling_params_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompt_rejected_before_any_work(tiny_llm):
    engine = tiny_llm.engine
    steps_before = engine.worker.runner.num_compilations, engine.block_manager.num_free_blocks
    too_long = {"prompt_token_ids": [5] * 300}
    with pytest.raises(ValueError, match=r"prompt 1: .*300 tokens.*max_model_len=256"):
        tiny_llm.generate(["fine", too_long], use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_llm.generate([{"prompt_token_ids": [1, 10**6]}], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"logit_bias names token ids \[1000000\] outside the vocabulary"):
        tiny_llm.generate("fine", SamplingParams(logit_bias={3: 1.0, 10**6: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        tiny_llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert (engine.worker.runner.num_compilations, engine.block_manager.num_free_blocks) == steps_before
    # The engine still serves after the rejections.
    assert len(_greedy(tiny_llm, "fine", max_tokens=3).token_ids) == 3


def test_missing_model_and_unsupported_architecture(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"), show_progress=False)
    import json
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"FancyNewForCausalLM.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        LLM(str(bad), show_progress=False)


def test_not_yet_implemented_options_say_so(tiny_model_dir):
    with pytest.raises(NotImplementedError):
        LLM(tiny_model_dir, show_progress=False, quantization="bitsandbytes")
    # Tensor parallelism exists (tests/paged/test_tensor_parallel.py); here there is one device for it.
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 devices; found 1"):
        LLM(tiny_model_dir, show_progress=False, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(tiny_model_dir, show_progress=False, attention_backend="flash")
    with pytest.raises(ValueError, match="layer_loop must be 'auto', 'scan' or 'unroll', got 'while'"):
        LLM(tiny_model_dir, show_progress=False, layer_loop="while")
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_model_dir, show_progress=False, dtype="int3")
