"""A request's state as it moves through the engine."""

from __future__ import annotations

import enum
import itertools

from paged.detokenizer import IncrementalDetokenizer
from paged.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Token ids (prompt then output), progress, and the KV blocks a request holds.

    `num_computed_tokens` counts tokens whose K/V are in the cache. The scheduler computes tokens until it
    catches up with `len(token_ids)`; that one rule covers prefill, chunked prefill and decode.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int, detokenizer: IncrementalDetokenizer | None,
                 eos_token_ids: tuple[int, ...] = ()):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.arrival = next(_arrival_counter)
        self.detokenizer = detokenizer
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.page_row: int | None = None  # this request's row of the page table while it holds blocks
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
