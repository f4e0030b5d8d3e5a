"""The runner's step: the LM head inside the sampler's branches, and the fused greedy head where it applies."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged.models.linear import GREEDY_SCREEN
from paged.models.llama import LastHidden, LlamaForCausalLM
from paged.models.tiny import create_tiny_llama
from paged.kernels import cpu
from paged.kernels.cpu import screen as screening
from paged import LLM, SamplingParams


@pytest.fixture(scope="module")
def tied_bf16_llm(tmp_path_factory):
    if not cpu.transposed_matmul_native():
        pytest.skip("neither AMX nor AVX-512 BF16 on this CPU: the tied LM head keeps XLA's einsum, and no kernel "
                    "fuses the argmax")
    directory = create_tiny_llama(str(tmp_path_factory.mktemp("tied")), tie_word_embeddings=True)
    return LLM(directory, dtype="bfloat16", linear_backend="cpu", block_size=8, max_num_seqs=8,
               max_model_len=256, show_progress=False)


def _prompts(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(2, 400, size=int(length)).tolist()}
            for length in rng.integers(3, 40, size=n)]


def test_greedy_head_is_offered_only_where_a_kernel_fuses_it(tied_bf16_llm):
    model = tied_bf16_llm.engine.worker.runner.model
    params = tied_bf16_llm.engine.worker.runner.params
    last = LastHidden(jnp.zeros((4, model.config.hidden_size), jnp.bfloat16), jnp.int32(4))
    assert callable(model.greedy_head(params, last))
    for change in (dict(final_soft_cap=30.0), dict(padded_vocab_size=model.config.vocab_size + 64)):
        other = LlamaForCausalLM(dataclasses.replace(model.config, **change), jnp.bfloat16, "cpu")
        assert other.greedy_head(params, last) is None, change
    assert LlamaForCausalLM(model.config, jnp.bfloat16, "xla").greedy_head(params, last) is None
    untied = LlamaForCausalLM(dataclasses.replace(model.config, tie_word_embeddings=False), jnp.bfloat16, "cpu")
    assert untied.greedy_head(params, last) is None


def test_fused_greedy_tokens_equal_the_argmax_of_the_logits(tied_bf16_llm):
    """Plain greedy steps take the fused head; asking for logprobs sends the same steps through the logits and
    the sampler's argmax, which see the same float32 sums: the tokens must match exactly, alone and when one
    request of the batch wants logprobs (the whole batch then takes the logits)."""
    prompts = _prompts(6, 0)
    fused = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with_logits = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    fused_out = [o.outputs[0].token_ids for o in tied_bf16_llm.generate(prompts, fused, use_tqdm=False)]
    logits_out = [o.outputs[0].token_ids for o in tied_bf16_llm.generate(prompts, with_logits, use_tqdm=False)]
    mixed_out = [o.outputs[0].token_ids for o in tied_bf16_llm.generate(
        prompts, [with_logits] + [fused] * (len(prompts) - 1), use_tqdm=False)]
    assert fused_out == logits_out == mixed_out
    assert len({tuple(t) for t in fused_out}) > 1  # the prompts lead to different continuations


@pytest.fixture(scope="module")
def wide_tied_dir(tmp_path_factory):
    """A tied model with 4,096 table rows: enough that the greedy head's screen decides (a few hundred rows
    would mostly send the call to the whole table)."""
    if not screening.screen_native():
        pytest.skip("no AMX-INT8 here: the greedy head reads the whole table, with no screen")
    return create_tiny_llama(str(tmp_path_factory.mktemp("wide")), tie_word_embeddings=True, model_vocab_size=4096)


def _tied_llm(directory: str, **options) -> LLM:
    return LLM(directory, dtype="bfloat16", linear_backend="cpu", block_size=8, max_num_seqs=8, max_model_len=256,
               show_progress=False, **options)


def _fused_and_logits_tokens(llm: LLM, prompts) -> tuple[list, list]:
    """(plain greedy tokens: the fused head's, and the same requests' with logprobs: the logits' argmax)."""
    fused = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with_logits = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    return ([o.outputs[0].token_ids for o in llm.generate(prompts, fused, use_tqdm=False)],
            [o.outputs[0].token_ids for o in llm.generate(prompts, with_logits, use_tqdm=False)])


def test_the_screened_greedy_head_gives_the_logits_tokens(wide_tied_dir):
    """The screen sits beside the weights (not among what is saved or updated), and greedy steps through it
    give the tokens of the logits' argmax and of an engine without it."""
    llm = _tied_llm(wide_tied_dir)
    worker = llm.engine.worker
    assert GREEDY_SCREEN in worker.runner.params and GREEDY_SCREEN not in llm.get_params()
    prompts = _prompts(8, 1)
    fused, logits = _fused_and_logits_tokens(llm, prompts)
    assert fused == logits and len({tuple(t) for t in fused}) > 1
    plain = _tied_llm(wide_tied_dir, greedy_head_screen=False)
    assert GREEDY_SCREEN not in plain.engine.worker.runner.params
    assert _fused_and_logits_tokens(plain, prompts)[0] == fused
    # A pooling engine over the same checkpoint has no LM head step to screen.
    assert GREEDY_SCREEN not in _tied_llm(wide_tied_dir, runner="pooling").engine.worker.runner.params


def test_updated_weights_rebuild_the_screen(wide_tied_dir):
    """A new table (the old one's rows reordered: the same values, other tokens) gets its own screen: greedy
    steps then give the new logits' tokens, not what a screen of the old table would pick."""
    llm = _tied_llm(wide_tied_dir)
    prompts = _prompts(6, 2)
    before = _fused_and_logits_tokens(llm, prompts)[0]
    params = jax.tree.map(np.asarray, llm.get_params())
    table = params["embed_tokens"]["embedding"]
    params["embed_tokens"]["embedding"] = table[np.random.default_rng(0).permutation(table.shape[0])]
    llm.update_weights(params)
    fused, logits = _fused_and_logits_tokens(llm, prompts)
    assert fused == logits and fused != before
