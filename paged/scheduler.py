"""Continuous-batching scheduler: FCFS admission (round-robin across tenants, paged/waiting_queue.py), token
budget, preemption by recompute or swap.

Each step it decides how many tokens each request computes: running requests first (oldest first), then
waiting ones. A request computes tokens until `num_computed_tokens` catches up with its token list, so a
fresh prompt, a chunk of one, a prefix-cache hit, a resumed request and a decode step are the same case.

Preemption policy (when a running request needs a block and none is free): the newest running request is
preempted. With `preemption_mode="swap"` its K/V are copied to host memory while the swap space has room, and
copied back when it resumes; otherwise (the default, "recompute") its blocks are dropped and it prefills its
prompt and output so far again (prefix-cache hits make that cheap). Recompute is the default because on one
device a prefill of a few hundred tokens costs about as much as moving their K/V twice over PCIe, and it needs
no host memory; swap pays off for long contexts on slow-compute devices.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING
from paged.block_manager import BlockManager
from paged.prefix_keys import prefix_root
from paged.request import Request, RequestStatus
from paged.waiting_queue import WaitingQueue

if TYPE_CHECKING:
    from paged.lora_slots import LoRASlots


@dataclasses.dataclass
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]
    preempted: list[Request]
    # The rows whose new tokens end in proposals to verify (speculative decoding): row -> how many.
    num_drafts: dict[int, int] = dataclasses.field(default_factory=dict)

    def drafts_of(self, row: int) -> int:
        return self.num_drafts.get(row, 0)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def prompt_tokens_per_row(self) -> list[int]:
        """Prompt tokens each row computes (not its generated ones being recomputed); read before launch."""
        return [max(0, min(n, r.num_prompt_tokens - r.num_computed_tokens))
                for r, n in zip(self.requests, self.num_new_tokens)]

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, swapper=None, rope_recompute: tuple[int, str] | None = None,
                 lora_slots: "LoRASlots | None" = None, propose=None, speculation_limit: int | None = None):
        """`swapper` (optional) moves a request's K/V to host and back: swap_out(request) -> bool,
        swap_in(request) after its blocks are allocated. `rope_recompute` (length, rope class): a sequence
        that reaches `length` tokens recomputes its K/V with the frequencies of that class (Phi-3's LongRoPE
        switch to its long factors, ModelConfig.rope_recompute_len). `lora_slots`: the device slots of LoRA
        adapters (paged/lora_slots.py); a request with an adapter runs only while it holds one, and one whose
        adapter cannot have a slot now is passed over by those behind it (as vLLM's scheduler does).
        `propose(request, limit) -> list[int]`: speculative decoding's proposer (paged/speculative.py): up to
        `limit` tokens appended to a decoding request that may speculate, computed with its next token and
        verified when the step is read back; not while `speculation_limit` or more requests run (a full batch
        is compute-bound: computing proposals there costs more than it saves). A proposer that runs a model
        (paged/draft_model.py) also has `begin_step(candidates, running)`, called first with every (request,
        limit) that may speculate, so that it drafts for all of them at once."""
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.swapper = swapper
        self.rope_recompute = rope_recompute
        self.lora_slots = lora_slots
        self.propose = propose
        self.speculation_limit = speculation_limit
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_swaps = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [], [])
        budget = self.max_num_batched_tokens
        if hasattr(self.propose, "begin_step"):
            self.propose.begin_step([(request, room) for request in self.running
                                     if (room := self._draft_room(request)) > 0], self.running)

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.length_limit is not None and request.num_tokens >= request.length_limit:
                index += 1  # its token in flight is its last: it finishes once that token is read
                continue
            if self.rope_recompute is not None:
                self._switch_rope(request)
            if self.propose is not None:
                self._add_drafts(request, budget)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, batch):
                break  # `request` itself was preempted; everything after it already was
            batch.requests.append(request)
            batch.num_new_tokens.append(num_new)
            if request.num_drafts:
                batch.num_drafts[len(batch.requests) - 1] = request.num_drafts
            budget -= num_new
            index += 1

        # Admitting new work in a step that had to preempt would only thrash.
        while self.waiting and not batch.preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self._next_admissible()
            if request is None:
                break  # every waiting request's adapter waits for a slot
            num_new = self._admit(request, budget)
            if num_new == 0:
                self._release_lora(request)
                break  # FCFS: the head waits for room rather than being overtaken
            if request is self.waiting.peek():
                self.waiting.popleft()
            else:
                self.waiting.remove(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.requests.append(request)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch

    def may_propose(self) -> bool:
        """Whether the next step may carry proposals: the engine speculates and fewer than speculation_limit
        requests run."""
        return self.propose is not None and (self.speculation_limit is None
                                             or len(self.running) < self.speculation_limit)

    def _draft_room(self, request: Request) -> int:
        """How many proposals `request` may carry this step, the step's budget aside: none unless it is about
        to compute its one next token and may speculate; within its length limit (its last verified token
        must stay within it)."""
        if request.num_computed_tokens != request.num_tokens - 1 or not may_speculate(request):
            return 0
        if not self.may_propose():
            return 0
        room = self.max_num_batched_tokens
        if request.length_limit is not None:
            room = min(room, request.length_limit - request.num_tokens - 1)
        if self.rope_recompute is not None and request.rope_length_floor < self.rope_recompute[0]:
            # Tokens predicted from a sequence of the recompute length or longer come after its recompute.
            room = min(room, self.rope_recompute[0] - 1 - request.num_tokens)
        return room

    def _add_drafts(self, request: Request, budget: int) -> None:
        """Appends the proposer's tokens to a request about to compute its one next token, within the step's
        budget and `_draft_room`."""
        room = min(budget - 1, self._draft_room(request))
        drafts = self.propose(request, room) if room > 0 else []
        if request.grammar is not None:  # a proposal the grammar rejects can never be accepted
            drafts = drafts[:request.grammar.valid_prefix([int(t) for t in drafts])]
        request.token_ids.extend(int(t) for t in drafts)
        request.num_drafts = len(drafts)

    def _next_admissible(self) -> Request | None:
        """The request admission takes next: the queue's head, unless its LoRA adapter can have no slot now;
        then the first request behind it that can run. Its adapter's slot is taken."""
        head = self.waiting.peek()
        if self.lora_slots is None:
            return head
        for request in (head, *self.waiting):
            if request.lora_request is None:
                return request
            if self.lora_slots.can_acquire(request.lora_request):
                request.lora_slot = self.lora_slots.acquire(request.lora_request)
                return request
        return None

    def _release_lora(self, request: Request) -> None:
        """Gives back the LoRA slot `request` held (it stopped running, or could not start)."""
        if request.lora_slot >= 0:
            self.lora_slots.release(request.lora_slot)
            request.lora_slot = -1

    def _admit(self, request: Request, budget: int) -> int:
        """Gives a waiting request its blocks; returns the tokens it computes now (0: it cannot start)."""
        bm = self.block_manager
        if self.rope_recompute is not None:
            self._switch_rope(request)
        if request.swapped_kv is not None:
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget:
                num_new = budget if self.enable_chunked_prefill else 0
            if num_new == 0 or not bm.allocate(request, request.num_computed_tokens + num_new):
                return 0
            self.swapper.swap_in(request)
            return num_new
        cached = bm.match_prefix(request)
        request.num_computed_tokens = cached
        num_new = request.num_tokens - cached
        if num_new > budget:
            num_new = budget if self.enable_chunked_prefill else 0
        if num_new == 0 or not bm.allocate(request, cached + num_new):
            bm.free(request)
            request.num_computed_tokens = 0
            return 0
        if request.num_cached_tokens is None:
            request.num_cached_tokens = cached
        if bm.enable_prefix_caching:
            bm.prefix_queries += (request.num_tokens - 1) // bm.block_size
            bm.prefix_hits += cached // bm.block_size
        return num_new

    def _switch_rope(self, request: Request) -> None:
        """When `request` first reaches the recompute length, it forgets the K/V it computed with the short
        frequencies (they stay in the prefix cache for others) and computes everything again from a chain of
        the new rope class. A prompt that long was computed that way from the start."""
        length, rope_class = self.rope_recompute
        if request.rope_length_floor >= length or request.num_tokens < length:
            return
        request.rope_length_floor = length
        if request.num_prompt_tokens >= length:
            return
        if request.swapped_kv is not None:
            self.swapper.release(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.prefix_root = prefix_root(request.cache_salt, rope_class,
                                          request.lora_request.lora_name if request.lora_request else None)
        request.block_hashes = []

    def _allocate_or_preempt(self, request: Request, num_new: int, batch: ScheduledBatch) -> bool:
        """Finds blocks for `request`, preempting the newest running requests as needed."""
        while not self.block_manager.allocate(request, request.num_computed_tokens + num_new):
            victim = self.running.pop()
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        request.drop_drafts()
        if self.swapper is not None and self.swapper.swap_out(request):
            self.num_swaps += 1  # K/V now on the host; num_computed_tokens stays
        else:
            request.num_computed_tokens = 0  # recompute: drop the K/V, keep the tokens
        self.block_manager.free(request)
        self._release_lora(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def fork(self, leader: Request, child: Request) -> tuple[int, int] | None:
        """Starts `child` from `leader`'s computed prompt (parallel sampling).

        The child shares every full block before the one holding the last prompt token, and gets a private
        copy of that block: it recomputes the last prompt token (to draw its own first sample) and writes its
        own tokens there. Returns the (source, destination) block copy to make, or None when it cannot fork
        now (then it waits and prefills like any request, through the prefix cache when enabled).
        """
        bm = self.block_manager
        last = leader.num_prompt_tokens - 1
        shared = last // bm.block_size
        if len(self.running) >= self.max_num_seqs or bm.num_free_blocks == 0 or (
                child.lora_request is not None and not self.lora_slots.can_acquire(child.lora_request)):
            self.waiting.append(child)
            return None
        if child.lora_request is not None:
            child.lora_slot = self.lora_slots.acquire(child.lora_request)
        bm.share(child, leader.block_ids[:shared])
        bm.allocate(child, (shared + 1) * bm.block_size)
        child.num_computed_tokens = last
        child.num_cached_tokens = leader.num_cached_tokens
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        return leader.block_ids[shared], child.block_ids[shared]

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Marks `request` finished and frees its blocks at once (running or waiting)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING and request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
        self._release_lora(request)
        if self.swapper is not None:
            self.swapper.release(request)
        request.drop_drafts()  # never verified: not part of the output
        request.drop_placeholders()
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason


def may_speculate(request: Request) -> bool:
    """Whether proposed tokens can be verified for `request`: greedy or sampled, with logprobs, penalties,
    logit_bias or a grammar (each verified position's adjustments are its own); not while min_tokens bans
    stop ids, nor while a grammar waits for the end of reasoning (which only the text shows)."""
    params = request.params
    return (request.pooling is None and request.num_output_tokens >= params.min_tokens
            and (request.grammar is None or request.grammar_after is None))
