"""Rows a request adjusts are sampled apart, in shapes compiled at start-up: no request compiles anything."""

from __future__ import annotations

import numpy as np
import pytest

from paged import LLM, SamplingParams
from paged.batch import Buckets
from paged.logit_adjustments import RowAdjustment, build_adjustments, entries_bucket, rows_bucket
from paged.sampler import SamplingMetadata


@pytest.fixture(scope="module")
def warm_llm(tiny_model_dir):
    llm = LLM(tiny_model_dir, block_size=8, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
              show_progress=False)
    llm.engine.precompile()
    return llm


def test_no_request_option_compiles_after_precompile(warm_llm):
    """Every option that once changed the step's shapes (logit_bias widths, penalties over prompts of any
    length, min_tokens bans, grammar masks on or off, logprobs, prompt logprobs), alone and mixed in one
    batch, with every row or only some adjusted."""
    engine = warm_llm.engine
    vocab = engine.model_config.vocab_size
    assert engine.num_compilations > len(engine.buckets.all_shapes())  # the adjusted sampling compiled too
    warm = engine.num_compilations
    long_prompt = list(range(3, 3 + 100))
    options = [
        SamplingParams(max_tokens=4, logit_bias={1: 1.0}),
        SamplingParams(max_tokens=4, logit_bias={i: 0.5 for i in range(300)}),
        SamplingParams(max_tokens=4, logit_bias={i: -0.5 for i in range(min(vocab, 1024))}),
        SamplingParams(max_tokens=12, repetition_penalty=1.2, temperature=0.5, seed=1),
        SamplingParams(max_tokens=4, presence_penalty=1.0, frequency_penalty=0.5, logprobs=20),
        SamplingParams(max_tokens=8, min_tokens=6, stop_token_ids=list(range(min(vocab, 1024)))),
        SamplingParams(max_tokens=8, structured_outputs={"regex": "[0-9]+"}),
        SamplingParams(max_tokens=8, structured_outputs={"json": {"type": "object"}}, logprobs=5, top_p=0.5,
                       temperature=1.0, seed=2),
        SamplingParams(max_tokens=4, logprobs=0),
        SamplingParams(max_tokens=4, temperature=0.8, top_k=3, min_p=0.1, seed=3),
        SamplingParams(max_tokens=2, prompt_logprobs=5),
        SamplingParams(max_tokens=2, prompt_logprobs=0, logprobs=1, repetition_penalty=1.1),
    ]
    for params in options:
        for prompt in ("Hello", {"prompt_token_ids": long_prompt}):
            warm_llm.generate(prompt, params, use_tqdm=False)
            assert engine.num_compilations == warm, params
    warm_llm.generate(["Hello"] * len(options), options, use_tqdm=False)  # several adjusted rows at once
    warm_llm.generate([{"prompt_token_ids": long_prompt}] * 4, [options[3]] * 4, use_tqdm=False)  # all of them
    assert engine.num_compilations == warm


def test_adjusted_rows_sample_as_the_fused_step_did(warm_llm):
    """Greedy under logit_bias: the biased token wins on every row that asks, and rows that do not ask are
    unchanged by sharing the batch with them."""
    engine = warm_llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=6)
    plain = warm_llm.generate(["Hello", "The quick"], greedy, use_tqdm=False)
    forced = SamplingParams(temperature=0, max_tokens=6, logit_bias={7: 100.0})
    mixed = warm_llm.generate(["Hello", "The quick", "Hello"], [greedy, forced, forced], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids == [7] * 6 and mixed[2].outputs[0].token_ids == [7] * 6
    assert engine.block_manager.num_free_blocks > 0


def test_entries_merge_a_rows_biases_bans_and_penalised_tokens():
    """One entry per distinct token: biases of a repeated id add up (a ban wins), counts and the penalised flag
    come from the penalty list; padding rows and entries point past the real ones."""
    sampling = SamplingMetadata(temperature=np.array([0.0, 0.7, 0.0], np.float32), top_k=np.zeros(3, np.int32),
                                top_p=np.ones(3, np.float32), min_p=np.zeros(3, np.float32),
                                seeds=np.array([4, 5, 6], np.uint32), output_index=np.array([1, 2, 3], np.int32),
                                wants_logprobs=np.array([False, True, False]))
    rows = [RowAdjustment(1, [5, 5, 2, 8], [1.0, 2.0, 0.5, -np.inf], penalties=(0.1, 0.2, 1.3),
                          penalty_ids=np.array([2, 9]), penalty_counts=np.array([0, 3])),
            RowAdjustment(2, [4], [-1.0])]
    adj = build_adjustments(rows, sampling, max_rows=4, mask_words=2)
    assert adj.shape == (2, 64)
    assert adj.rows.tolist() == [1, 2] and int(adj.num_rows) == 2
    assert adj.sampling.temperature.tolist() == pytest.approx([0.7, 0.0])
    assert adj.sampling.seeds.tolist() == [5, 6] and adj.sampling.wants_logprobs.tolist() == [True, False]
    assert adj.repetition_penalty.tolist() == pytest.approx([1.3, 1.0])
    assert (adj.allowed_tokens == -1).all()
    real = adj.entry_rows < 2
    got = sorted(zip(adj.entry_rows[real].tolist(), adj.entry_tokens[real].tolist(), adj.entry_bias[real].tolist(),
                     adj.entry_counts[real].tolist(), adj.entry_penalised[real].tolist()))
    assert got == [(0, 2, 0.5, 0, True), (0, 5, 3.0, 0, False), (0, 8, -np.inf, 0, False), (0, 9, 0.0, 3, True),
                   (1, 4, -1.0, 0, False)]
    assert (adj.entry_rows[~real] == 2).all() and real.sum() == 5


@pytest.mark.parametrize("max_num_seqs, max_model_len, vocab", [(4, 128, 470), (256, 4096, 151_936), (3, 64, 50)])
def test_every_reachable_shape_is_among_those_compiled_ahead(max_num_seqs, max_model_len, vocab):
    buckets = Buckets(2048, max_num_seqs, vocab_size=vocab, max_model_len=max_model_len)
    shapes = set(buckets.adjustment_shapes())
    per_row = min(vocab, max_model_len + 1024 + 1024 + 8)  # prompt and output, logit_bias, stop ids, eos
    for num_rows in range(1, max_num_seqs + 1):
        r = rows_bucket(num_rows, max_num_seqs)
        for entries in (0, 1, per_row, num_rows * per_row):
            assert (r, entries_bucket(entries)) in shapes, (num_rows, entries)
