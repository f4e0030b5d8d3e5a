"""Prometheus metrics, named like vLLM's with a `paged:` prefix. Updated on each engine's thread.

Every engine series carries `model_name` and `engine`, the data-parallel replica (`data_parallel_rank`; "0"
with one engine), as vLLM's do: Prometheus sums over `engine` for the server's totals. The server's own
series (requests by route, API key and outcome; tokens by key) carry `model_name` and `key_name`, the key's
name (never its secret). The process's CPU and memory are exported too (`process_*`).
"""

from __future__ import annotations

import time

import jax
from paged.outputs import PoolingRequestOutput
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector, generate_latest

# How a generation request ended, for `paged:api_requests{outcome}`: ok; aborted (the client left, or the
# server shut down under it); failed (its step failed: a 500 or an error event); invalid (another 4xx);
# unauthorized (401); rate_limited (429); overloaded (503, the waiting queue is full); unavailable (503, the
# engine is not running).
OUTCOMES = ("ok", "aborted", "failed", "invalid", "unauthorized", "rate_limited", "overloaded", "unavailable")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


def _memory_stats(device) -> dict | None:
    """The allocator's figures for a device of this process (None where the platform reports none: CPU; a
    device of another host of a multi-host mesh)."""
    if device.process_index != jax.process_index():
        return None
    try:
        return device.memory_stats()
    except Exception:  # noqa: BLE001 - a metric must never fail the engine thread it runs on
        return None


class EngineMetrics:
    """Owns a registry of its own, so several servers (or tests) in one process never collide."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        r = self.registry
        self.running = Gauge("paged:num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("paged:num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.kv_usage = Gauge("paged:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", labels,
                              registry=r)
        self.prefix_queries = Counter("paged:prefix_cache_queries", "Prefix-cache lookups, in blocks", labels,
                                      registry=r)
        self.prefix_hits = Counter("paged:prefix_cache_hits", "Prefix-cache hits, in blocks", labels, registry=r)
        self.prompt_tokens = Counter("paged:prompt_tokens", "Prompt tokens of finished requests", labels,
                                     registry=r)
        self.generation_tokens = Counter("paged:generation_tokens", "Generated tokens", labels, registry=r)
        self.preemptions = Counter("paged:num_preemptions", "Preemptions (recompute or swap)", labels, registry=r)
        self.success = Counter("paged:request_success", "Finished requests by finish reason",
                               labels + ["finished_reason"], registry=r)
        self.constrained = Counter("paged:structured_output_requests", "Requests with a structured-output "
                                   "constraint (JSON schema, regex, choice, grammar)", labels, registry=r)
        self.grammars_compiled = Counter("paged:structured_output_grammars_compiled", "Grammars compiled (cache "
                                         "misses)", labels, registry=r)
        self.grammar_compile_seconds = Counter("paged:structured_output_compile_seconds", "Time spent compiling "
                                               "grammars", labels, registry=r)
        hist = lambda name, doc: Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = hist("paged:time_to_first_token_seconds", "Time to first token")
        self.itl = hist("paged:inter_token_latency_seconds", "Time between consecutive output tokens")
        self.e2e = hist("paged:e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = hist("paged:request_queue_time_seconds", "Arrival to first scheduled")
        # A compile after start-up is a stall for every running request: this should stay flat while serving.
        self.compilations = Counter("paged:step_compilations", "Device programs compiled (step shapes, sampling "
                                    "and block moves traced for a new shape)", labels, registry=r)
        # vLLM's spec-decode counters: rows that carried proposals, proposed and accepted tokens, and accepted
        # tokens by position in the proposal.
        self.spec_drafts = Counter("paged:spec_decode_num_drafts", "Rows that carried proposed tokens", labels,
                                   registry=r)
        self.spec_draft_tokens = Counter("paged:spec_decode_num_draft_tokens", "Proposed tokens", labels, registry=r)
        self.spec_accepted_tokens = Counter("paged:spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                                            labels, registry=r)
        self.spec_accepted_per_position = Counter("paged:spec_decode_num_accepted_tokens_per_pos",
                                                  "Proposed tokens accepted at each position of a proposal",
                                                  labels + ["position"], registry=r)
        # vLLM's LoRA gauge: its labels say which adapters are in the running batch and which wait; the value
        # is when that was read (one series per replica, replaced at each update).
        self.lora_info = Gauge("paged:lora_requests_info", "LoRA adapters of running and waiting requests",
                               labels + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self.pooling_requests = Counter("paged:pooling_requests", "Finished requests of a pooling model, by task "
                                        "(embed, classify, score)", labels + ["task"], registry=r)
        self.api_requests = Counter("paged:api_requests", "Generation and pooling requests by route, API key name and outcome",
                                    ["model_name", "key_name", "route", "outcome"], registry=r)
        self.api_tokens = Counter("paged:api_key_tokens", "Tokens by API key name: admitted prompt tokens and "
                                  "generated tokens", ["model_name", "key_name", "kind"], registry=r)
        self.device_memory_used = Gauge("paged:device_memory_used_bytes", "Accelerator memory in use, where the "
                                        "platform reports it (not on CPU)", labels + ["device"], registry=r)
        self.device_memory_limit = Gauge("paged:device_memory_limit_bytes", "Accelerator memory the allocator "
                                         "may use, where the platform reports it", labels + ["device"], registry=r)
        self.info = Info("paged:engine", "What this server runs: version, model, dtype, backends, mesh",
                         registry=r)
        ProcessCollector(registry=r)
        self.model_name = model_name
        self._lora_series: dict[tuple[str, str], tuple[str, ...]] = {}  # each replica's current LoRA series
        # Called with (key name, tokens) for every generated token batch (the key ring's charge).
        self.usage_hook = None
        # Per request id (engine thread and event loop; single dict operations): its API key's name.
        self._key_of: dict[str, str] = {}
        # Per replica, the engine's running totals as last copied into the counters.
        self._seen: dict[int, dict[str, float]] = {}
        # Per request (ids are unique across replicas): tokens counted and when the last one came.
        self._tokens_seen: dict[str, int] = {}
        self._last_token_time: dict[str, float] = {}

    def _advance(self, counter, labels: tuple[str, str], rank: int, key: str, total: float) -> None:
        """Adds what a running total of replica `rank` gained since it was last read."""
        seen = self._seen.setdefault(rank, {})
        counter.labels(*labels).inc(max(0.0, total - seen.get(key, 0)))
        seen[key] = total

    def describe(self, engine) -> None:
        """The info metric, from the first engine (every replica runs the same configuration)."""
        from paged import __version__
        config, model = engine.config, engine.model_config
        mesh = dict(engine.mesh.shape) if engine.mesh is not None else {}
        self.info.info({"version": __version__, "model_name": self.model_name, "architecture": model.architecture,
                        "dtype": engine.dtype.name, "kv_cache_dtype": engine.kv_dtype.name,
                        "attention_backend": str(engine.attention_name), "linear_backend": str(engine.linear_backend),
                        "platform": engine.devices[0].platform,
                        "mesh": ",".join(f"{axis}={size}" for axis, size in mesh.items()) or "none",
                        "data_parallel_size": str(config.data_parallel_size),
                        "max_model_len": str(config.max_model_len), "block_size": str(config.block_size)})

    def attribute(self, request_id: str, key_name: str) -> None:
        """Counts request `request_id`'s generated tokens under API key `key_name`."""
        self._key_of[request_id] = key_name

    def count_request(self, key_name: str, route: str, outcome: str) -> None:
        # `outcome` is one of OUTCOMES (tests/serving/test_metrics.py holds outcome_of to that); a metric never
        # refuses a request, so nothing is checked here.
        self.api_requests.labels(self.model_name, key_name, route, outcome).inc()

    def count_prompt_tokens(self, key_name: str, tokens: int) -> None:
        self.api_tokens.labels(self.model_name, key_name, "prompt").inc(tokens)

    def update_gauges(self, engine) -> None:
        """Reads the engine's state (call on the engine thread); also done after every step. What costs more to
        read is read only when /metrics is scraped (`update_on_scrape`)."""
        rank = engine.config.data_parallel_rank
        labels = (self.model_name, str(rank))
        stats = engine.kv_stats(include_utilization=False)
        self.running.labels(*labels).set(stats["num_running"])
        self.waiting.labels(*labels).set(stats["num_waiting"])
        self.kv_usage.labels(*labels).set(stats["kv_cache_usage"])
        self._advance(self.preemptions, labels, rank, "preemptions", stats["num_preemptions"])
        self._advance(self.prefix_queries, labels, rank, "queries", stats["prefix_cache_queries"])
        self._advance(self.prefix_hits, labels, rank, "hits", stats["prefix_cache_hits"])
        self._advance(self.constrained, labels, rank, "constrained", engine.num_constrained_requests)
        self._advance(self.compilations, labels, rank, "compilations", engine.num_compilations)
        if engine.speculative is not None:
            self._spec_counts(engine.spec_stats, labels, rank)
        # Replicas share one grammar cache, compiled on server workers: its totals are counted on replica 0.
        if engine.grammars is not None and rank == 0:
            self._advance(self.grammars_compiled, labels, rank, "compiled", engine.grammars.num_compiled)
            self._advance(self.grammar_compile_seconds, labels, rank, "compile_s", engine.grammars.compile_seconds)

    def _spec_counts(self, stats, labels: tuple[str, str], rank: int) -> None:
        self._advance(self.spec_drafts, labels, rank, "spec_drafts", stats.num_drafts)
        self._advance(self.spec_draft_tokens, labels, rank, "spec_draft_tokens", stats.num_draft_tokens)
        self._advance(self.spec_accepted_tokens, labels, rank, "spec_accepted", stats.num_accepted_tokens)
        seen = self._seen.setdefault(rank, {})
        for position, total in enumerate(stats.accepted_per_position):
            key = f"spec_accepted_{position}"
            self.spec_accepted_per_position.labels(*labels, str(position)).inc(max(0, total - seen.get(key, 0)))
            seen[key] = total

    def _lora_info(self, engine, labels: tuple[str, str]) -> None:
        waiting = {r.lora_request.lora_name for r in engine.scheduler.waiting if r.lora_request is not None}
        series = (*labels, str(engine.lora_slots.config.max_loras),
                  ",".join(sorted(engine.lora_slots.running_adapters())), ",".join(sorted(waiting)))
        previous = self._lora_series.get(labels)
        if previous is not None and previous != series:
            self.lora_info.remove(*previous)
        self._lora_series[labels] = series
        self.lora_info.labels(*series).set(time.time())

    def update_on_scrape(self, engine) -> None:
        """What is read only when /metrics is scraped (call on the engine thread): the LoRA adapters running and
        waiting (a walk of the waiting queue), and the allocator's bytes in use and limit for each of this
        process's devices of `engine` (on a GPU, a runtime call per device)."""
        labels = (self.model_name, str(engine.config.data_parallel_rank))
        if engine.lora_slots is not None:
            self._lora_info(engine, labels)
        for device in engine.devices:
            stats = _memory_stats(device)
            if stats and "bytes_in_use" in stats:
                self.device_memory_used.labels(*labels, str(device.id)).set(stats["bytes_in_use"])
                if "bytes_limit" in stats:
                    self.device_memory_limit.labels(*labels, str(device.id)).set(stats["bytes_limit"])

    def on_step(self, engine, outputs, step_start: float, step_end: float) -> None:
        self.update_gauges(engine)
        m = (self.model_name, str(engine.config.data_parallel_rank))
        now = time.monotonic()
        for output in outputs:
            key = output.request_id
            if isinstance(output, PoolingRequestOutput):  # one output, when its vector is done
                self._pooled(output, m, now)
                continue
            total = sum(len(c.token_ids) for c in output.outputs)
            new = total - self._tokens_seen.get(key, 0)
            self._tokens_seen[key] = total
            self.generation_tokens.labels(*m).inc(new)
            key_name = self._key_of.get(key)
            if key_name is not None and new:
                self.api_tokens.labels(self.model_name, key_name, "generation").inc(new)
                if self.usage_hook is not None:
                    self.usage_hook(key_name, new)
            times = output.metrics
            if key not in self._last_token_time:
                self.ttft.labels(*m).observe(now - times.arrival_time)
                if times.first_scheduled_time is not None:
                    self.queue_time.labels(*m).observe(times.first_scheduled_time - times.arrival_time)
            elif new:
                self.itl.labels(*m).observe((now - self._last_token_time[key]) / new)
            self._last_token_time[key] = now
            if output.finished:
                self.prompt_tokens.labels(*m).inc(len(output.prompt_token_ids))
                for completion in output.outputs:
                    self.success.labels(*m, completion.finish_reason or "unknown").inc()
                self.e2e.labels(*m).observe(now - times.arrival_time)
                self._tokens_seen.pop(key, None)
                self._last_token_time.pop(key, None)
                self._key_of.pop(key, None)

    def _pooled(self, output: PoolingRequestOutput, m: tuple[str, str], now: float) -> None:
        self.prompt_tokens.labels(*m).inc(len(output.prompt_token_ids))
        self.pooling_requests.labels(*m, output.task or "embed").inc()
        self.success.labels(*m, "stop").inc()
        if output.metrics is not None:
            self.e2e.labels(*m).observe(now - output.metrics.arrival_time)
            if output.metrics.first_scheduled_time is not None:
                self.queue_time.labels(*m).observe(output.metrics.first_scheduled_time - output.metrics.arrival_time)
        self._key_of.pop(output.request_id, None)

    def forget(self, request_id: str) -> None:
        """Drops per-request state of an aborted request."""
        self._tokens_seen.pop(request_id, None)
        self._last_token_time.pop(request_id, None)
        self._key_of.pop(request_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)
