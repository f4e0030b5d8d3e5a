"""A step's samples in, `RequestOutput`s out: each row's token accepted into its request, logprobs recorded,
text detokenized incrementally, stop conditions checked (EOS, stop ids and strings, grammar end, length), the
samples of an n > 1 request forked from its leader, prefix-cache keys and sliding-window releases updated."""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from paged.batch import PromptLogprobSpan
from paged.block_manager import BlockManager
from paged.detokenizer import find_stop_string
from paged.outputs import (CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestMetrics,
                           RequestOutput)
from paged.pooler import finish_embedding, finish_scores
from paged.pooling_params import PoolerConfig
from paged.request import ParentRequest, Request, RequestStatus
from paged.sampler import PromptLogprobs, SamplerOutput
from paged.scheduler import ScheduledBatch, Scheduler
from paged.speculative import SpecDecodeStats

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ProcessedStep:
    """What one step's samples made: the outputs of the requests that took a token, and the block copies
    (source, destination) their forks need, to run on the device before anything reuses a source block."""

    outputs: list[RequestOutput]
    block_copies: list[tuple[int, int]]


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, tokenizer, eos_token_ids: tuple[int, ...],
                 release_window: int, spec_stats: SpecDecodeStats | None = None):
        """`release_window`: when every layer slides, the widest window (blocks wholly behind it are freed as
        sequences advance); 0 otherwise. `spec_stats`: where verified proposals are counted."""
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.release_window = release_window
        self.spec_stats = spec_stats

    def process(self, batch: ScheduledBatch, token_index: list[int], sampled: SamplerOutput,
                prompt_spans: list[PromptLogprobSpan] = ()) -> ProcessedStep:
        """`token_index[row]`: where row's sample goes in its request's token_ids (-1 for a prefill chunk,
        whose sample is not a real next token); `sampled`: the step's samples as host arrays;
        `prompt_spans`: which of its prompt-logprob rows belong to which request (paged/batch.py)."""
        touched: dict[str, ParentRequest] = {}
        copies = []
        for span in prompt_spans:
            if not span.request.finished:
                self._record_prompt_logprobs(span, sampled.prompt)
        # Each speculating row's verified samples, in row order: its last verified token's, then each proposal's.
        verify_ends = np.cumsum([batch.drafts_of(i) + 1 if batch.drafts_of(i) else 0
                                 for i in range(len(batch.requests))])
        for i, (request, index) in enumerate(zip(batch.requests, token_index)):
            if request.finished:
                continue  # stopped or aborted while this step ran: its row is discarded
            first_verified = None
            if index >= 0 and batch.drafts_of(i):
                first_verified = verify_ends[i] - batch.drafts_of(i) - 1
                new_tokens = self._verify_drafts(request, sampled.verified.tokens[first_verified:verify_ends[i]])
            elif index >= 0:
                request.token_ids[index] = int(sampled.tokens[i])
            self.block_manager.cache_full_blocks(request)
            if self.release_window:
                self.block_manager.free_outside_window(request, self.release_window)
            if index < 0:
                continue
            parent = request.parent
            # The samples fork from the leader's prompt blocks; a leader preempted while this step ran (async
            # scheduling) has none now, and forks them at its next token instead.
            if parent.pending_forks and request is parent.leader and request.status is RequestStatus.RUNNING:
                copies += self._fork(parent)
            if first_verified is None:
                if request.logprobs is not None:
                    self._record_logprobs(request, sampled, i)
                self._accept_token(request, index)
            else:
                for j, token in enumerate(new_tokens):  # one at a time: a stop among them ends the output there
                    request.token_ids.append(token)
                    if request.logprobs is not None:  # the target's, as drawn
                        self._record_logprobs(request, sampled.verified, first_verified + j)
                    self._accept_token(request, request.num_tokens - 1)
                    if request.finished:
                        break
            if request.finished and request.detokenizer is not None and not isinstance(request.stop_reason, str):
                request.text += request.detokenizer.flush()
            touched[parent.request_id] = parent
        return ProcessedStep([output_of(parent) for parent in touched.values()], copies)

    def process_pooled(self, batch: ScheduledBatch, pooled, config: PoolerConfig) -> ProcessedStep:
        """A pooling step's rows (float32 [S, D] host array): each request's vector finished as it asks
        (paged/pooler.py) and the request finished with it."""
        outputs = []
        for row, request in enumerate(batch.requests):
            if request.finished:
                continue  # aborted while its step ran
            params = request.pooling
            vector = pooled[row]
            vector = finish_scores(vector, params, config) if params.task in ("classify", "score") else \
                finish_embedding(vector, params, config)
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            self.scheduler.finish(request, "stop")
            metrics = RequestMetrics(request.arrival_time, request.first_scheduled_time, request.first_token_time,
                                     time.monotonic())
            outputs.append(PoolingRequestOutput(request.parent.request_id, PoolingOutput(vector),
                                                request.prompt_token_ids, True, 0, metrics, params.task))
        return ProcessedStep(outputs, [])

    def _record_logprobs(self, request: Request, sampled: SamplerOutput, row: int) -> None:
        k = request.params.logprobs
        logprob = float(sampled.token_logprobs[row])
        request.logprobs.append(logprob_entry(int(sampled.tokens[row]), logprob, int(sampled.token_ranks[row]),
                                              sampled.top_ids[row, :k].tolist(), sampled.top_logprobs[row, :k].tolist(),
                                              self._decode_one))
        request.cumulative_logprob += logprob

    def _record_prompt_logprobs(self, span: PromptLogprobSpan, computed: PromptLogprobs) -> None:
        request = span.request
        entries, k = request.prompt_logprobs, request.params.prompt_logprobs
        rows = slice(span.offset, span.offset + span.count)
        token_logprobs, ranks = computed.token_logprobs[rows].tolist(), computed.token_ranks[rows].tolist()
        top_ids, top_logprobs = computed.top_ids[rows, :k].tolist(), computed.top_logprobs[rows, :k].tolist()
        targets = request.prompt_token_ids[span.first_position:span.first_position + span.count]
        decoded = self._decode_many({*targets, *(t for ids in top_ids for t in ids)})
        for j, position in enumerate(range(span.first_position, span.first_position + span.count)):
            if position != len(entries):
                continue  # held from before a preemption made the prompt run again
            entries.append(logprob_entry(targets[j], token_logprobs[j], ranks[j], top_ids[j], top_logprobs[j],
                                         decoded.get))

    def _decode_many(self, tokens: set[int]) -> dict[int, str]:
        if self.tokenizer is None:
            return {}
        return dict(zip(tokens, self.tokenizer.batch_decode([[t] for t in tokens])))

    def _decode_one(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def _fork(self, parent: ParentRequest) -> list[tuple[int, int]]:
        copies = []
        for child in parent.pending_forks:
            pair = self.scheduler.fork(parent.leader, child)
            if pair is not None:
                copies.append(pair)
        parent.pending_forks = []
        return copies

    def _verify_drafts(self, request: Request, drawn: np.ndarray) -> list[int]:
        """Checks a row's proposed tokens against the target's tokens drawn after each of its packed tokens
        (`drawn`: after the last verified token, then after each proposal; greedy or sampled as the request
        asks): the leading proposals equal to them are accepted, then the drawn token after the last accepted
        one (ModelRunner._verify: exact rejection sampling). The rest leave token_ids, and the request's
        computed tokens end after the last accepted one (the rejected positions' K/V are written over later).
        Returns the tokens to append, in order."""
        drafts = request.token_ids[request.num_tokens_before_drafts:request.num_tokens_before_drafts
                                   + request.num_drafts]
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == int(drawn[accepted]):
            accepted += 1
        if self.spec_stats is not None:
            self.spec_stats.record(len(drafts), accepted)
        request.drop_drafts()  # and the placeholder after them
        request.num_computed_tokens = request.num_tokens + accepted
        # The blocks allocated for rejected proposals go back (the next token's own is kept).
        self.block_manager.free_tail(request, request.num_tokens + accepted + 1)
        return [*drafts[:accepted], int(drawn[accepted])]

    def _accept_token(self, request: Request, index: int) -> None:
        """Checks the token just read into token_ids[index] against the request's stop conditions (finishing
        drops a token sampled after it, still in flight with async scheduling)."""
        params = request.params
        token = request.token_ids[index]
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        delta = request.detokenizer.add(token) if request.detokenizer is not None else ""
        request.text += delta
        grammar_done = False
        if request.grammar is not None and request.grammar_after is not None:
            # The grammar waits for its marker (the end of a reasoning model's thinking); only the text this
            # token added, and the marker's length before it, can complete it.
            marker = request.grammar_after
            if request.text.find(marker, max(0, len(request.text) - len(delta) - len(marker) + 1)) >= 0:
                request.grammar_after = None  # it shapes the tokens from the next one on
        elif request.grammar is not None:
            if not request.grammar.accept(token):  # only if every token was masked (e.g. min_tokens vs. EOS)
                logger.warning("request %s: its grammar rejected token %d (%s)", request.request_id, token,
                               request.grammar.error)
                return self.scheduler.finish(request, "abort")
            grammar_done = request.grammar.is_terminated
        num_out = index + 1 - request.num_prompt_tokens
        if num_out >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                return self.scheduler.finish(request, "stop")
            if token in params.stop_token_id_set:
                return self.scheduler.finish(request, "stop", token)
            if params.stop and delta:
                match = find_stop_string(request.text, len(delta), params.stop)
                if match is not None:
                    stop, position = match
                    end = position + len(stop) if params.include_stop_str_in_output else position
                    request.text = request.text[:end]
                    return self.scheduler.finish(request, "stop", stop)
        if grammar_done:  # the output is complete: nothing but EOS could follow
            return self.scheduler.finish(request, "stop")
        if index + 1 >= request.length_limit:
            return self.scheduler.finish(request, "length")


def logprob_entry(token: int, logprob: float, rank: int, top_ids: list[int], top_logprobs: list[float],
                  decode) -> dict[int, Logprob]:
    """One position's logprobs in vLLM's layout: the chosen (or prompt) token's first, then the top k by rank
    (a top token that is the chosen one keeps a single entry). `decode(token id)`: its text, or None."""
    entry = {token: Logprob(logprob, rank, decode(token))}
    for top_rank, (tid, lp) in enumerate(zip(top_ids, top_logprobs), start=1):
        entry.setdefault(tid, Logprob(lp, top_rank, decode(tid)))
    return entry


def output_of(parent: ParentRequest) -> RequestOutput:
    """The request's RequestOutput as it stands: every sample's text, tokens and logprobs so far."""
    completions = [CompletionOutput(index=c.index, text=c.text, token_ids=c.output_token_ids,
                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                    cumulative_logprob=c.cumulative_logprob,
                                    logprobs=list(c.logprobs) if c.logprobs is not None else None)
                   for c in parent.children]
    leader = parent.leader
    finished = parent.finished
    metrics = RequestMetrics(leader.arrival_time, leader.first_scheduled_time, leader.first_token_time,
                             time.monotonic() if finished else None)
    prompt_logprobs = list(leader.prompt_logprobs) if leader.prompt_logprobs is not None else None
    return RequestOutput(request_id=parent.request_id, prompt=leader.prompt, prompt_token_ids=leader.prompt_token_ids,
                         outputs=completions, finished=finished, num_cached_tokens=leader.num_cached_tokens or 0,
                         metrics=metrics, prompt_logprobs=prompt_logprobs)
