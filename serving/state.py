"""What every handler reads (`ServerState`, a FastAPI dependency), and the server's per-request limits."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

from fastapi import Depends, Request

from paged.lora import LoRARequest
from paged.serving.api_keys import ANONYMOUS, KeyRing
from paged.serving.async_engine import AsyncEngine
from paged.serving.metrics import EngineMetrics
from paged.serving.replicas import ReplicatedEngine
from paged.serving.response_store import ResponseStore


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one request may make the server do (`paged serve` flags)."""

    # Larger bodies are a 413 before any of it is parsed.
    max_request_body_bytes: int = 4 * 2**20
    # A client's own `chat_template` runs Jinja on this server: only when the operator allows it (vLLM keeps
    # this behind a flag too).
    allow_request_chat_template: bool = False
    # Top logprobs a request may ask for per token (logprobs, top_logprobs, prompt_logprobs), as vLLM's
    # --max-logprobs; at most paged.sampling_params.MAX_LOGPROBS, the width the step computes.
    max_logprobs: int = 20
    # Prompts in one completions request (a batch): each is a request of its own to the engine.
    max_prompts_per_request: int = 4096
    # Logprob entries a non-streamed reply may carry: n x max tokens x (top logprobs + 1), summed over its
    # prompts (a 64 x 490 x 21 reply is 46 MB of JSON). Streams send the same entries a chunk at a time.
    max_reply_logprobs: int = 2**20
    # Stored Responses (previous_response_id, GET /v1/responses/{id}): their JSON bytes in all (0: none kept)
    # and how long each is kept.
    responses_store_bytes: int = 64 * 2**20
    responses_store_ttl_s: float = 3600.0


@dataclasses.dataclass
class ServerState:
    """What every handler reads: the engine and the server's settings."""

    engine: AsyncEngine | ReplicatedEngine  # one engine, or data-parallel replicas behind one interface
    served_model_name: str
    metrics: EngineMetrics | None = None
    keys: KeyRing = dataclasses.field(default_factory=lambda: KeyRing([]))  # none: no auth, no limits
    model_path: str | None = None
    limits: ServerLimits = ServerLimits()
    tool_call_parser: str | None = None  # finds calls in tool_choice=auto outputs; None: auto is refused
    reasoning_parser: str | None = None  # separates a reasoning model's thinking (paged/reasoning.py)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    # LoRA adapters served by name (`--lora-modules`, /v1/load_lora_adapter): a request names one as its model.
    lora_adapters: dict[str, LoRARequest] = dataclasses.field(default_factory=dict)
    # Tokenization and chat templates run here, off the event loop and the engine thread.
    workers: ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=2, thread_name_prefix="paged-tokenize"))

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """Text longer than this cannot fit max_model_len tokens (no token is longer than the vocabulary's
        longest), so it is refused without tokenizing it."""
        tokenizer = self.tokenizer
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer is not None else 1
        return self.max_model_len * max(longest, 1)

    @functools.cached_property
    def response_store(self) -> ResponseStore:
        return ResponseStore(self.limits.responses_store_bytes, self.limits.responses_store_ttl_s)

    async def in_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def model_names(self) -> set[str]:
        return {self.served_model_name} | ({self.model_path} if self.model_path else set())


def _state(request: Request) -> ServerState:
    return request.app.state.paged


State = Annotated[ServerState, Depends(_state)]


def key_name(raw: Request) -> str:
    """The name of the API key the request came with (set by BearerAuth)."""
    key = raw.scope.get("paged.api_key")
    return key.name if key is not None else ANONYMOUS
