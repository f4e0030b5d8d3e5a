"""A request's state as it moves through the engine."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from paged.detokenizer import IncrementalDetokenizer
from paged.prefix_keys import DEFAULT_ROOT
from paged.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged.grammar import GrammarMatcher
    from paged.lora import LoRARequest
    from paged.pooling_params import PoolingParams


# Stands in token_ids for a token the device has sampled but the host has not read yet (async scheduling):
# the next step takes that token straight from the previous step's output on the device.
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One sequence: token ids (prompt then output), progress, and the KV blocks it holds.

    `num_computed_tokens` counts tokens whose K/V are in the cache (or will be, once the steps already
    launched finish). The scheduler computes tokens until it catches up with `len(token_ids)`; that one rule
    covers prefill, chunked prefill, prefix hits and decode. With async scheduling the last token may be a
    PLACEHOLDER, sampled by the step in flight at row `placeholder_row` of its batch.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int, detokenizer: IncrementalDetokenizer | None,
                 eos_token_ids: tuple[int, ...] = (), index: int = 0, parent: "ParentRequest | None" = None,
                 length_limit: int | None = None, grammar: "GrammarMatcher | None" = None,
                 prefix_root: bytes | None = None, tenant: str | None = None, cache_salt: str | None = None,
                 lora_request: "LoRARequest | None" = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.tenant = tenant  # whom it is accounted to (an API key's name): admission is fair across tenants
        # Total tokens at which it finishes by length (max_tokens or max_model_len); None: no limit.
        self.length_limit = length_limit
        self.grammar = grammar  # where the output stands in its structured-output grammar, if it has one
        # While set, the grammar waits: it starts with the token after the output first holds this text.
        self.grammar_after = params.structured_outputs_after if grammar is not None else None
        self.placeholder_row = -1
        self.seed = seed
        self.index = index  # position among the n samples of its parent
        self.parent = parent
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.detokenizer = detokenizer
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache, once admitted
        self.block_ids: list[int] = []
        # The prefix cache's chain of full blocks starts here (block_manager.prefix_root: covers the cache salt).
        self.prefix_root = prefix_root if prefix_root is not None else DEFAULT_ROOT
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # the adapter it runs with (None: the base model)
        self.lora_slot = -1  # the device slot holding its adapter while it runs (paged/lora_slots.py)
        # Proposed tokens at the end of token_ids, computed by the step under way and not yet verified.
        self.num_drafts = 0
        # Rotary frequencies follow at least this sequence length (a length-dependent rope; raised when the
        # sequence switches to LongRoPE's long factors and recomputes its K/V).
        self.rope_length_floor = 0
        self.block_hashes: list[bytes] = []  # chain keys of full blocks, memoised for the prefix cache
        self.num_registered_blocks = 0  # leading full blocks already offered to the prefix cache
        self.page_row: int | None = None  # this request's row of the page table while it holds blocks
        self.swapped_kv = None  # host copy of the K/V while swapped out
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        # Per prompt position: None for the first token (nothing predicts it), then {token id: Logprob} of the
        # prompt's token and the top prompt_logprobs. Filled in order as the prompt is computed; the leader
        # of an n > 1 request holds them for all its samples.
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None and index == 0 else None
        # A pooling model's request (paged/pooling_params.py): its prompt's pooled vector is its output.
        self.pooling: "PoolingParams | None" = None
        self.token_type_ids: list[int] | None = None  # an encoder's sentence-pair segments (None: all 0)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens produced and read back so far (without those still in flight)."""
        end = len(self.token_ids)
        while end > self.num_prompt_tokens and self.token_ids[end - 1] == PLACEHOLDER:
            end -= 1
        return self.token_ids[self.num_prompt_tokens:end]

    @property
    def num_output_tokens(self) -> int:
        """Tokens produced, counting those still in flight (what the next sample's index depends on)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def missing_prompt_logprobs(self) -> bool:
        """Whether some prompt logprob it asked for is still to be computed (its prompt cannot then come from
        the prefix cache, which keeps K/V but no logits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def drop_drafts(self) -> None:
        """Removes unverified proposed tokens from the end (and what followed them)."""
        if self.num_drafts:
            del self.token_ids[self.num_tokens_before_drafts:]
            self.num_drafts = 0

    @property
    def num_tokens_before_drafts(self) -> int:
        """Tokens before the proposals (with the placeholder after them, if any, counted out too)."""
        end = len(self.token_ids)
        if end and self.token_ids[-1] == PLACEHOLDER:
            end -= 1
        return end - self.num_drafts

    def drop_placeholders(self) -> None:
        """Removes tokens still in flight from the end (a finished request keeps only what it produced)."""
        while self.token_ids and self.token_ids[-1] == PLACEHOLDER:
            self.token_ids.pop()

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")


class ParentRequest:
    """What the user submitted: one prompt, `n` sampled sequences.

    Sequence 0 (the leader) prefills the prompt; the others wait in `pending_forks` and, once the prompt's
    K/V exist, fork from it: they share its full blocks and get a private copy of the block they will write.
    """

    def __init__(self, request_id: str, children: list[Request]):
        self.request_id = request_id
        self.children = children
        self.pending_forks: list[Request] = children[1:]
        for child in children:
            child.parent = self

    @property
    def leader(self) -> Request:
        return self.children[0]

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)
