"""Data parallelism behind one server: N engine replicas, each request sent to the least loaded one.

Each replica is a whole LLMEngine (its own scheduler, KV pool and copy of the weights) on its own
`tensor_parallel_size` devices (`data_parallel_rank`), run by its own AsyncEngine thread. `ReplicatedEngine`
offers the AsyncEngine methods the server calls, so the handlers do not know how many replicas there are.

Routing, on the event loop: a request goes to the replica with the fewest requests in flight (submitted and
not yet finished: running plus waiting, counted here exactly rather than read from another thread), the
emptier KV pool breaking ties. A replica whose prefix cache already holds the prompt's leading blocks is
preferred while it carries at most `prefix_affinity_slack` more requests than the least loaded one: a hit
saves the prefill, but sending every request with a shared system prompt to one replica would idle the rest.
"""

from __future__ import annotations

from paged import LoRARequest, PoolingParams, SamplingParams
from paged.prefix_keys import prefix_chain
from paged.serving.async_engine import AsyncEngine, EngineDeadError, Generating, RequestStream


class ReplicatedEngine(Generating):
    def __init__(self, replicas: list[AsyncEngine], prefix_affinity_slack: int = 4):
        if not replicas:
            raise ValueError("ReplicatedEngine needs at least one replica")
        self.replicas = replicas
        self.prefix_affinity_slack = prefix_affinity_slack
        self.in_flight = [0] * len(replicas)  # per replica: submitted, not yet finished (event loop only)
        self.routed = [0] * len(replicas)  # per replica: requests sent to it
        self.prefix_routed = 0  # requests sent to a replica for its cached prefix rather than its load
        # One grammar cache for all: the server compiles a constraint once, whichever replica then runs it.
        grammars = replicas[0].engine.grammars
        for replica in replicas[1:]:
            replica.engine.grammars = grammars

    # ---- what the server reads ------------------------------------------------------------------------

    @property
    def engine(self):
        """The first replica's LLMEngine: its tokenizer, config and model config are every replica's."""
        return self.replicas[0].engine

    @property
    def alive(self) -> bool:
        return all(replica.alive for replica in self.replicas)

    @property
    def started(self) -> bool:
        return all(replica.started for replica in self.replicas)

    @property
    def error(self) -> BaseException | None:
        return next((replica.error for replica in self.replicas if replica.error is not None), None)

    def start(self) -> None:
        for replica in self.replicas:
            if not replica.started:
                replica.start()

    def stop(self, timeout: float = 10.0) -> None:
        for replica in self.replicas:
            replica.stop(timeout)

    def fail_all(self, message: str) -> None:
        for replica in self.replicas:
            replica.fail_all(message)

    async def call(self, fn):
        """Runs fn(engine) on the first replica's thread (see AsyncEngine.call); `replicas` reaches the rest."""
        return await self.replicas[0].call(fn)

    # ---- routing --------------------------------------------------------------------------------------

    def choose(self, prompt_token_ids: list[int] | None, cache_salt: str | None = None) -> int:
        """The replica for a request with these prompt tokens (None: not tokenized; load alone decides)."""
        def kv_usage(i: int) -> float:
            manager = self.replicas[i].engine.block_manager
            return manager.num_used_blocks / manager.num_usable_blocks

        live = [i for i, replica in enumerate(self.replicas) if replica.alive]
        if not live:
            raise EngineDeadError("no engine replica is running")
        least = min(live, key=lambda i: (self.in_flight[i], kv_usage(i)))
        config = self.engine.config
        if not prompt_token_ids or not config.enable_prefix_caching:
            return least
        # The last prompt token is always computed, so only blocks before it can be hits.
        hashes = prefix_chain(prompt_token_ids, config.block_size, (len(prompt_token_ids) - 1) // config.block_size,
                              cache_salt)
        if not hashes:
            return least
        hits = {i: self.replicas[i].engine.block_manager.num_cached_leading(hashes) for i in live}
        best = max(live, key=lambda i: (hits[i], -self.in_flight[i]))
        if hits[best] > hits[least] and self.in_flight[best] - self.in_flight[least] <= self.prefix_affinity_slack:
            self.prefix_routed += 1
            return best
        return least

    async def submit(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                     params: SamplingParams | PoolingParams, cache_salt: str | None = None,
                     tenant: str | None = None, token_type_ids: list[int] | None = None,
                     lora_request: LoRARequest | None = None) -> RequestStream:
        """AsyncEngine.submit on the chosen replica; the stream counts toward its load until it ends."""
        # An invalid salt is the chosen engine's to refuse; routing only needs a string.
        # (An adapter's prefix blocks are keyed apart: its prompts are routed by load alone.)
        index = self.choose(prompt_token_ids if lora_request is None else None,
                            cache_salt if isinstance(cache_salt, str) else None)
        self.in_flight[index] += 1
        try:
            stream = await self.replicas[index].submit(request_id, prompt, prompt_token_ids, params, cache_salt,
                                                      tenant, token_type_ids, lora_request)
        except BaseException:
            self.in_flight[index] -= 1
            raise
        self.routed[index] += 1

        def done() -> None:  # on the event loop, where the server reads and closes its streams
            self.in_flight[index] -= 1

        stream.on_done = done
        return stream
