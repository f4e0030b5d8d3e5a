"""Continuous-batching scheduler: FCFS admission, token budget, recompute preemption.

Each step it decides how many tokens each request computes: running requests first (oldest first), then
waiting ones. A request computes tokens until `num_computed_tokens` catches up with its token list, so a
fresh prompt, a chunk of one, a resumed (preempted) request and a decode step are the same case.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from paged.block_manager import BlockManager
from paged.request import Request, RequestStatus


@dataclasses.dataclass
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]
    preempted: list[Request]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [], [])
        budget = self.max_num_batched_tokens

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, batch):
                break  # `request` itself was preempted; everything after it already was
            batch.requests.append(request)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
            index += 1

        # Admitting new work in a step that had to preempt would only thrash.
        while self.waiting and not batch.preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break  # FCFS: the head waits for a step with room rather than being overtaken
                num_new = budget
            if not self.block_manager.allocate(request, request.num_computed_tokens + num_new):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.requests.append(request)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch

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
        # Recompute preemption: drop the K/V, keep the tokens; resuming prefills prompt + output so far.
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Marks `request` finished and frees its blocks at once (running or waiting)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
