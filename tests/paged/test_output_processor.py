"""paged/output_processor.py on the host alone (no model, no device): a step's samples in, RequestOutputs
out, with the stop checks, logprobs and forks it owns."""

from __future__ import annotations

import numpy as np

from paged import SamplingParams
from paged.block_manager import BlockManager
from paged.output_processor import OutputProcessor
from paged.request import PLACEHOLDER, ParentRequest, Request
from paged.sampler import SamplerOutput
from paged.sampling_params import MAX_LOGPROBS
from paged.scheduler import Scheduler

EOS = 2
PROMPT = [5, 6, 7, 8, 9]


def _engine_side(params: SamplingParams):
    """A scheduler with one request of `params.n` samples, and the processor over it."""
    blocks = BlockManager(32, 4, 8, 16, enable_prefix_caching=True)
    scheduler = Scheduler(blocks, 8, 64, True)
    children = [Request("r" if params.n == 1 else f"r#{i}", None, PROMPT, params, seed=i, detokenizer=None,
                        eos_token_ids=(EOS,), index=i, length_limit=len(PROMPT) + (params.max_tokens or 100))
                for i in range(params.n)]
    parent = ParentRequest("r", children)
    scheduler.add(parent.leader)
    return scheduler, OutputProcessor(scheduler, blocks, None, (EOS,), 0), parent


def _step(scheduler: Scheduler, processor: OutputProcessor, tokens: list[int], top: list[int] | None = None):
    """Schedules a step, advances its rows as the engine's launch does, and hands the processor `tokens`."""
    batch = scheduler.schedule()
    token_index = []
    for request, num_new in zip(batch.requests, batch.num_new_tokens):
        request.num_computed_tokens += num_new
        token_index.append(request.num_tokens)
        request.token_ids.append(PLACEHOLDER)
    rows = len(batch.requests)
    top_ids = np.zeros((rows, MAX_LOGPROBS), np.int32)
    top_logprobs = np.full((rows, MAX_LOGPROBS), -50.0, np.float32)
    if top is not None:
        top_ids[:, :len(top)] = top
        top_logprobs[:, :len(top)] = np.log(np.linspace(0.5, 0.1, len(top)))
    sampled = SamplerOutput(np.array(tokens[:rows], np.int32), np.full(rows, -0.25, np.float32),
                            np.ones(rows, np.int32), top_ids, top_logprobs)
    return processor.process(batch, token_index, sampled)


def test_tokens_are_accepted_until_a_stop_token_id():
    scheduler, processor, parent = _engine_side(SamplingParams(max_tokens=10, stop_token_ids=[44]))
    for token in (40, 41):
        (output,) = _step(scheduler, processor, [token]).outputs
        assert not output.finished
    (output,) = _step(scheduler, processor, [44]).outputs
    assert output.finished and output.request_id == "r"
    assert output.outputs[0].token_ids == [40, 41, 44]
    assert (output.outputs[0].finish_reason, output.outputs[0].stop_reason) == ("stop", 44)
    assert output.prompt_token_ids == PROMPT and not scheduler.has_unfinished()


def test_eos_waits_for_min_tokens_and_length_ends_the_rest():
    scheduler, processor, _ = _engine_side(SamplingParams(max_tokens=10, min_tokens=2))
    assert not _step(scheduler, processor, [EOS]).outputs[0].finished  # one output token: under min_tokens
    (output,) = _step(scheduler, processor, [EOS]).outputs
    assert output.finished and (output.outputs[0].finish_reason, output.outputs[0].stop_reason) == ("stop", None)
    scheduler, processor, _ = _engine_side(SamplingParams(max_tokens=2))
    _step(scheduler, processor, [EOS + 1])
    (output,) = _step(scheduler, processor, [EOS + 2]).outputs
    assert output.finished and output.outputs[0].finish_reason == "length"
    assert output.outputs[0].token_ids == [EOS + 1, EOS + 2]


def test_logprobs_hold_the_sample_and_the_top_k():
    scheduler, processor, _ = _engine_side(SamplingParams(max_tokens=1, logprobs=2))
    (output,) = _step(scheduler, processor, [30], top=[31, 30, 32]).outputs
    (entry,) = output.outputs[0].logprobs
    assert set(entry) == {30, 31}  # the sample and the top 2 (30 is among them: one entry)
    assert entry[30].logprob == np.float32(-0.25) and entry[30].rank == 1
    assert entry[31].rank == 1 and np.isclose(entry[31].logprob, np.log(0.5))
    assert np.isclose(output.outputs[0].cumulative_logprob, -0.25)


def test_the_samples_of_n_fork_from_the_leader_with_a_block_copy():
    scheduler, processor, parent = _engine_side(SamplingParams(n=2, max_tokens=3))
    processed = _step(scheduler, processor, [50])
    assert len(processed.block_copies) == 1  # the leader's partial last prompt block, copied for the fork
    source, destination = processed.block_copies[0]
    assert source == parent.leader.block_ids[-1] and destination == parent.children[1].block_ids[-1]
    assert not parent.pending_forks
    (output,) = processed.outputs
    assert [c.token_ids for c in output.outputs] == [[50], []]
