"""Greedy outputs match Hugging Face transformers token for token (float32, tiny random checkpoints)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.hf_checkpoints import SPECS, build_checkpoint, hf_greedy, hf_log_softmax

from paged import LLM, SamplingParams

MAX_NEW = 24
# Lengths around block boundaries for block sizes 8 and 16, and past Mistral's window of 24.
PROMPT_LENGTHS = [1, 5, 8, 13, 16, 17, 33, 40]


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(2, vocab, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=sorted(SPECS))
def checkpoint(request, tmp_path_factory):
    directory = build_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))
    from paged.models import load_model_config
    prompts = _prompts(load_model_config(directory).vocab_size)
    return request.param, directory, prompts, hf_greedy(directory, prompts, MAX_NEW)


def _generate(directory, prompts, **engine_args):
    llm = LLM(directory, dtype="float32", show_progress=False, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


@pytest.mark.torch
@pytest.mark.parametrize("block_size, engine_args", [
    (8, {}), (16, {}), (16, {"attention_backend": "xla", "layer_loop": "scan"})],
    ids=["bs8", "bs16", "bs16-xla-scan"])
def test_greedy_matches_transformers(checkpoint, block_size, engine_args):
    """On CPU, "auto" means the native kernel and unrolled layers; the XLA attention over scanned layers is
    the path other platforms' defaults share."""
    name, directory, prompts, expected = checkpoint
    llm, got = _generate(directory, prompts, block_size=block_size, **engine_args)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{name} block_size={block_size} {engine_args} prompt {i} (len {len(prompts[i])}): {g} != {e}"
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_usable_blocks


@pytest.mark.torch
def test_pallas_kernels_match_transformers(checkpoint):
    """The Pallas backend (interpret mode here) on every family: windows, soft caps, GQA/MQA, chunked prompts."""
    name, directory, prompts, expected = checkpoint
    _, got = _generate(directory, prompts, block_size=8, attention_backend="pallas", max_num_batched_tokens=48)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{name} pallas prompt {i} (len {len(prompts[i])}): {g} != {e}"


@pytest.mark.torch
def test_greedy_matches_transformers_under_preemption(checkpoint):
    name, directory, prompts, expected = checkpoint
    # 8 sequences of up to 64 tokens need up to 64 blocks of 8; 10 usable blocks force preemption.
    llm, got = _generate(directory, prompts, block_size=8, num_kv_blocks=11, max_model_len=80)
    assert llm.engine.num_preemptions > 0
    assert got == expected
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_usable_blocks


@pytest.mark.torch
def test_sliding_window_releases_blocks_and_still_matches(tmp_path_factory):
    """Mistral slides on every layer (window 24): blocks behind the window go back to the pool as sequences
    advance, so a pool far smaller than 8 x max_model_len serves the batch without preemption, and the tokens
    still match transformers. Parallel sampling (forks share the released positions) stays leak-free."""
    directory = build_checkpoint("mistral-window", str(tmp_path_factory.mktemp("mistral-release")))
    prompts = _prompts(400)
    expected = hf_greedy(directory, prompts, 40)
    # 8 sequences of up to 80 tokens need 10 blocks of 8 each without releasing; with a window of 24 each
    # needs at most 5 (window + the block being written + a prompt chunk's spill).
    llm = LLM(directory, dtype="float32", block_size=8, num_kv_blocks=44, max_model_len=80, show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    assert got == expected
    stats = llm.engine.kv_stats()
    assert stats["blocks_released_outside_window"] > 0 and llm.engine.num_preemptions == 0
    forked = llm.generate([{"prompt_token_ids": prompts[-1]}], SamplingParams(n=3, temperature=1.0, seed=1,
                                                                              max_tokens=30), use_tqdm=False)
    assert len(forked[0].outputs) == 3
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks and not bm.ref_counts.any()


@pytest.mark.torch
def test_repetition_penalty_matches_transformers(tmp_path_factory):
    directory = build_checkpoint("llama-gqa", str(tmp_path_factory.mktemp("rep")))
    prompts = _prompts(400)[:4]
    expected = hf_greedy(directory, prompts, MAX_NEW, repetition_penalty=1.8)
    llm = LLM(directory, dtype="float32", block_size=8, show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.8)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False)]
    assert got == expected
    assert got != [o for o in hf_greedy(directory, prompts, MAX_NEW)], "the penalty must change something"


@pytest.mark.torch
def test_logit_bias_matches_transformers(tmp_path_factory):
    """logit_bias against transformers' sequence_bias with one-token sequences (an added bias per id)."""
    directory = build_checkpoint("llama-gqa", str(tmp_path_factory.mktemp("bias")))
    prompts = _prompts(400)[:4]
    unbiased = hf_greedy(directory, prompts, MAX_NEW)
    # Push down what the model would pick first and raise a few others, so the outputs must move.
    bias = {t: -4.0 for t in {out[0] for out in unbiased}} | {7: 2.5, 123: 3.0, 250: 1.5}
    expected = hf_greedy(directory, prompts, MAX_NEW, sequence_bias=[[[t], b] for t, b in bias.items()])
    assert expected != unbiased, "the bias must change something"
    llm = LLM(directory, dtype="float32", block_size=8, show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logit_bias=bias)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False)]
    assert got == expected


@pytest.mark.torch
def test_logprobs_match_transformers(tmp_path_factory):
    directory = build_checkpoint("qwen2-tied", str(tmp_path_factory.mktemp("logprobs")))
    prompt = _prompts(400)[4]
    llm = LLM(directory, dtype="float32", block_size=8, show_progress=False)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, logprobs=5)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    reference = hf_log_softmax(directory, prompt + out.token_ids)
    total = 0.0
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        want = reference[len(prompt) - 1 + step]
        top5 = np.argsort(-want)[:5]
        assert set(top5) | {token} == set(entry), f"step {step}: top-5 ids differ"
        for tid, logprob in entry.items():
            assert abs(logprob.logprob - want[tid]) < 1e-4
            assert logprob.rank == int((want > want[tid]).sum()) + 1
        total += want[token]
    assert abs(out.cumulative_logprob - total) < 1e-3


# bfloat16 keeps 8 significant bits, so two correct implementations that round in a different order (XLA and
# the native kernels against PyTorch's) drift apart by ~1e-2 in the logits over a few layers, and an MoE
# router's near tie can send a token to another expert. Two checks, both against transformers in bf16:
# - accuracy: along paged's own greedy path, paged's log-probabilities are as close to transformers' float32
#   ones as transformers' bf16 ones are (within BF16_ERROR_RATIO); a wrong kernel is off by whole nats;
# - tokens: each prompt's greedy tokens agree up to a first divergence that is a near tie for both engines
#   (each one's token among the other's top BF16_TOP_K, as vLLM's own bf16 tests accept). MoE models are held
#   to the accuracy check only: a routing flip at a near tie moves the output by more than any top-k.
BF16_TOP_K = 5
BF16_ERROR_RATIO = 2.0


@pytest.mark.torch
def test_bfloat16_matches_transformers_in_bfloat16(checkpoint):
    import torch
    import transformers

    name, directory, prompts, _ = checkpoint
    llm = LLM(directory, dtype="bfloat16", block_size=8, show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=BF16_TOP_K)
    outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                  use_tqdm=False)]
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    moe = "moe" in name
    paged_error = hf_error = 0.0
    compared = 0
    with torch.no_grad():
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            tokens = out.token_ids
            path = prompt + tokens
            reference = hf_log_softmax(directory, path)[len(prompt) - 1:-1]  # float32 transformers, float64
            hf = torch.log_softmax(bf16(torch.tensor([path])).logits[0].double(), -1).numpy()[len(prompt) - 1:-1]
            for j, token in enumerate(tokens):
                paged_error += abs(out.logprobs[j][token].logprob - reference[j, token])
                hf_error += abs(hf[j, token] - reference[j, token])
            if moe:
                continue
            ids = torch.tensor([prompt])
            expected = bf16.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=MAX_NEW, pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
            same = next((j for j, (a, b) in enumerate(zip(tokens, expected)) if a != b), len(tokens))
            compared += same
            if same < len(tokens):
                hf_top = np.argsort(-hf[same])[:BF16_TOP_K].tolist()
                assert tokens[same] in hf_top and expected[same] in out.logprobs[same], (
                    f"{name} prompt {i}: token {same} is {tokens[same]}, transformers {expected[same]}; not a near "
                    f"tie (transformers' top {BF16_TOP_K}: {hf_top}, paged's: {sorted(out.logprobs[same])})")
    assert paged_error <= BF16_ERROR_RATIO * hf_error + 1e-3 * len(prompts) * MAX_NEW, (
        f"{name}: paged bf16 is {paged_error:.2f} nats from float32 in all, transformers bf16 {hf_error:.2f}")
    if not moe:
        # Keeps the check from being vacuous (every sample diverging at once). Where a sample diverges depends on
        # the bf16 rounding of the CPU's path: qwen3-qknorm met its first near tie after 112 of 192 tokens on
        # AVX-512 BF16 without AMX (and after more on AMX); every divergence is checked to be a near tie above.
        assert compared >= 0.5 * len(prompts) * MAX_NEW, f"{name}: only {compared} tokens compared before ties"


@pytest.mark.torch
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-tied", "qwen3-qknorm"])
def test_yarn_rope_matches_transformers_past_the_original_length(name, tmp_path_factory):
    """YaRN as Qwen2.5 / Qwen3 configs spell it (factor 4 over an original 16 positions here, with a factor
    large enough that the attention scale differs from 1): tokens past position 16 as transformers gives."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
    directory = build_checkpoint(name, str(tmp_path_factory.mktemp(f"{name}-yarn")),
                                 overrides={"rope_parameters": yarn, "max_position_embeddings": 256})
    prompts = [p for p in _prompts(400) if len(p) > 16][:3]
    expected = hf_greedy(directory, prompts, MAX_NEW)
    llm, got = _generate(directory, prompts, block_size=8)
    assert llm.engine.model_config.rope.rope_type == "yarn"
    assert llm.engine.model_config.rope.attention_scaling > 1.1
    assert got == expected


def _hf_one_by_one(directory, prompts):
    # transformers' dynamic NTK keeps the longest length it has seen across generate calls (its frequencies
    # only grow until a prompt shorter than the original length resets them): a fresh model per prompt.
    return [hf_greedy(directory, [p], MAX_NEW)[0] for p in prompts]


DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 24,
            "short_factor": [1.0] * 8, "long_factor": [4.0, 8.0, 16.0, 32.0, 64.0, 64.0, 64.0, 64.0]}


@pytest.mark.torch
@pytest.mark.parametrize("name, rope, lengths", [
    ("llama-gqa", DYNAMIC, [5, 13, 17, 40]), ("qwen3-qknorm", DYNAMIC, [5, 17, 40]),
    ("phi3-fused", LONGROPE, [5, 13, 33, 40]),
    # Llama keeps the keys it computed with the short factors (only Phi-3 recomputes them): so does paged.
    ("llama-gqa", LONGROPE, [5, 33])],
    ids=["dynamic-llama", "dynamic-qwen3", "longrope-phi3", "longrope-llama"])
def test_length_dependent_rope_matches_transformers(name, rope, lengths, tmp_path_factory):
    """Dynamic NTK (past max_position_embeddings = 32) and LongRoPE (past an original 24): short prompts whose
    output crosses the length, and longer prompts computed in chunks of 16 tokens whose every token follows
    the prompt's length, as transformers' one forward does."""
    lengths_config = ({"max_position_embeddings": 32} if rope["rope_type"] == "dynamic" else
                      # Phi3Config keeps its own top-level original length (4096 by default) over the rope's
                      {"max_position_embeddings": 96, "original_max_position_embeddings": 24})
    directory = build_checkpoint(name, str(tmp_path_factory.mktemp(f"{name}-{rope['rope_type']}")),
                                 overrides={"rope_parameters": rope, **lengths_config})
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 400, size=n).tolist() for n in lengths]
    # The longest prompt's first 16 tokens under a short prompt: the same tokens, rotated another way.
    shared = prompts[-1][:16] + rng.integers(2, 400, size=4).tolist()
    expected = _hf_one_by_one(directory, prompts + [shared])
    expected, expected_shared = expected[:-1], expected[-1]
    llm, got = _generate(directory, prompts, block_size=8, max_num_batched_tokens=16, max_model_len=64,
                         enable_prefix_caching=False)
    assert llm.engine.model_config.rope.length_dependent
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{name} {rope['rope_type']} prompt {i} (len {len(prompts[i])}): {g} != {e}"
    # With the prefix cache, a second run finds the first's blocks, and only where they were rotated as it
    # rotates them (the prompt's rope class is part of every block's key).
    llm = LLM(directory, dtype="float32", block_size=8, max_num_batched_tokens=16, max_model_len=64,
              show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    for run in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected, run
    assert sum(o.num_cached_tokens for o in outputs) > 0
    (out,) = llm.generate({"prompt_token_ids": shared}, params, use_tqdm=False)
    assert out.outputs[0].token_ids == expected_shared
