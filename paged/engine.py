"""LLMEngine: requests in, outputs out; each `step()` is schedule -> prepare -> launch -> postprocess (of the
step launched before, with async scheduling)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import NoReturn

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from paged.models import get_attention_backend, load_model, load_model_config, resolve_model_path
from paged.models.attention import resolve_backends
from paged.models.builtin import builtin_model, random_weights_note
from paged.models.loader import weight_bytes
from paged import compilation_cache, multihost, startup
from paged.batch import Buckets, padding_inputs, prepare_inputs
from paged.block_manager import SINK_BLOCK, BlockManager
from paged.chat import text_token_ids
from paged.config import KV_CACHE_DTYPES, EngineConfig, engine_option_names
from paged.parallel import ShardedAttention, make_mesh, placement, replica_devices
from paged.detokenizer import IncrementalDetokenizer, find_stop_string
from paged.grammar import GrammarCompiler
from paged.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from paged.request import PLACEHOLDER, ParentRequest, Request, RequestStatus
from paged.runner import BlockMover, ModelRunner, kv_block_bytes, kv_budget_bytes
from paged.sampler import SamplerOutput
from paged.sampling_params import InvalidParameter, SamplingParams
from paged.scheduler import ScheduledBatch, Scheduler
from paged.trace import EngineTrace, StepRecord, record_step

logger = logging.getLogger(__name__)


def kv_cache_dtype(option: str, model_dtype) -> np.dtype:
    """The KV pool's dtype for the `kv_cache_dtype` option: the model's for "auto"."""
    name = KV_CACHE_DTYPES[option]
    return np.dtype(model_dtype if name is None else jnp.dtype(name))


class StepFailedError(RuntimeError):
    """A step raised; its requests (`request_ids`) were aborted and the engine goes on."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"the engine step failed ({type(cause).__name__}: {cause}); aborted requests: "
                         f"{', '.join(request_ids) or 'none'}")
        self.request_ids = request_ids
        self.cause = cause


class EngineBrokenError(RuntimeError):
    """The engine lost state it cannot rebuild (its KV pool); it must be restarted."""


class LLMEngine:
    def __init__(self, model: str, show_progress: bool = True, **engine_args):
        """`engine_args`: any EngineConfig field (paged/config.py), e.g. dtype="bfloat16", max_num_seqs=32."""
        unknown = sorted(set(engine_args) - set(engine_option_names()))
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; the options are the fields of "
                            f"paged.EngineConfig: {', '.join(engine_option_names())}")
        config = EngineConfig(**engine_args)
        config.validate()
        # Before JAX picks its devices: a multi-host run's mesh spans every process's (paged/multihost.py).
        self.channel = multihost.StepChannel() if multihost.initialize(config) else None
        tokenizer, dtype = config.tokenizer, config.dtype
        self.compilation_cache_dir = compilation_cache.configure(config.compilation_cache_dir)
        platform = jax.default_backend()

        started = time.perf_counter()
        builtin = builtin_model(model)  # the demo model and the tiny one are known by name, offline
        model_dir = builtin[0] if builtin else resolve_model_path(model)
        model_config = load_model_config(model_dir)
        devices = replica_devices(config.tensor_parallel_size, config.data_parallel_size, config.data_parallel_rank)
        self.mesh = make_mesh(config.tensor_parallel_size, model_config.num_heads, model_config.num_kv_heads,
                              devices)
        # A single-device replica other than the first commits its arrays to its own device (jitted steps then
        # run there); on the default device nothing changes.
        self.device = devices[0] if self.mesh is None and devices[0] != jax.devices()[0] else None
        if self.channel is not None:
            if config.preemption_mode == "swap":  # the leader holds only its own heads' K/V to swap out
                raise NotImplementedError("preemption_mode='swap' does not run over several processes yet")
            multihost.check_same_run(self.channel, multihost.fingerprint(config, model_config))
        self.devices = devices
        attention_name, self.linear_backend = resolve_backends(platform, config.attention_backend,
                                                               config.linear_backend, sharded=self.mesh is not None)
        attention = get_attention_backend(attention_name, platform)
        self.attention_name = attention_name
        if self.mesh is not None:
            attention = ShardedAttention(attention, self.mesh)
        unroll = config.layer_loop == "unroll" or (config.layer_loop == "auto" and platform == "cpu")
        model_dir, self.model_config, self.model, params, self.dtype = load_model(
            model_dir, dtype, show_progress, stacked_layers=not unroll, linear_backend=self.linear_backend,
            mesh=self.mesh, quantization=config.quantization, device=self.device,
            kv_cache_scales=config.kv_cache_dtype.startswith("fp8"))
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        if attention_name == "pallas-mosaic":  # refused here, not when the first step is traced
            if self.kv_dtype.itemsize == 1:
                raise NotImplementedError("kv_cache_dtype='fp8' does not run on the pallas-mosaic decode kernel yet; "
                                          "use attention_backend='pallas'")
            from paged.kernels.gpu.decode_mgpu import hopper_unsupported
            c = self.model_config
            reason = hopper_unsupported(self.dtype, self.kv_dtype, c.head_dim, config.block_size,
                                        c.num_heads // c.num_kv_heads)
            if reason is not None:
                raise ValueError(f"attention_backend='pallas-mosaic' cannot run this model: {reason}; use "
                                 "attention_backend='pallas'")
        # Bytes of the weights by dtype (int8, uint8 for packed int4, the float dtype for the rest) and total.
        self.weight_bytes = weight_bytes(params)
        self.config = config = config.resolved(self.model_config.max_position_embeddings)
        self.tokenizer = _load_tokenizer(tokenizer or model_dir)
        eos = self.model_config.eos_token_ids
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        self.eos_token_ids: tuple[int, ...] = eos
        self.grammars = (GrammarCompiler(self.tokenizer, self.model_config.vocab_size, eos,
                                         config.structured_outputs_disable_any_whitespace)
                         if self.tokenizer is not None else None)

        max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        # The budget is read on one of this process's own devices (a multi-host mesh also holds others').
        local = next((d for d in devices if d.process_index == jax.process_index()), devices[0])
        num_blocks = self._num_blocks(config, max_blocks_per_seq, local)
        if self.channel is not None:  # one pool size everywhere: what the tightest process can hold
            num_blocks = int(multihost_utils.process_allgather(np.int32(num_blocks)).min())
        self.block_manager = BlockManager(num_blocks, config.block_size, config.max_num_seqs, max_blocks_per_seq,
                                          config.enable_prefix_caching)
        self.buckets = Buckets(config.max_num_batched_tokens, config.max_num_seqs)
        precomputed = self.model.precomputed(config.max_model_len)
        if (where := placement(self.mesh, self.device)) is not None:  # beside the weights, not copied per step
            precomputed = jax.device_put(precomputed, where)
        params = {**params, **precomputed}
        self.runner = ModelRunner(self.model, params, attention, num_blocks, config.block_size, self.kv_dtype,
                                  config.max_num_seqs, self.mesh, self.device,
                                  publish=self.channel.publish if self.channel and self.channel.leader else None)
        block_bytes = kv_block_bytes(self.model_config, config.block_size, self.kv_dtype)
        self.kv_pool_bytes = num_blocks * block_bytes  # K and V over all layers, every device's share together
        swap_blocks = int(config.swap_space * 2**30) // block_bytes if config.preemption_mode == "swap" else 0
        self.mover = BlockMover(self.runner, self.block_manager, swap_blocks)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, self.mover if swap_blocks else None)
        # When every layer slides, blocks behind the widest window are released as sequences advance.
        windows = self.model_config.layer_windows
        self.release_window = max(windows) if windows and all(w > 0 for w in windows) else 0
        self.requests: dict[str, ParentRequest] = {}
        self.num_constrained_requests = 0  # requests added with a structured-output constraint
        self.num_computed_prompt_tokens = 0  # prompt tokens actually run through the model (not cache hits)
        # Host wall time per phase of step(), summed: "prepare" includes launching the jitted step, "device" is
        # the wait for its result (with async scheduling, only what the host work did not hide).
        self.step_timings = dict.fromkeys(("schedule", "prepare", "device", "postprocess", "steps",
                                           "device_decode_only", "device_with_prefill"), 0.0)
        self._seed_rng = np.random.default_rng(config.seed)
        self._in_flight: _InFlight | None = None  # the launched step not yet read back (async scheduling)
        self._scheduled: ScheduledBatch | None = None  # what the step under way scheduled (for _fail_step)
        self._trace: EngineTrace | None = None  # per-step records while start_trace() is in effect
        startup.compilation_cache_counts()  # counts the persistent cache's hits from here on
        self.model_name = model  # as the user named it
        self.model_description = builtin[1] if builtin else random_weights_note(model_dir)  # None for most
        startup.log_summary(self, time.perf_counter() - started)

    def _num_blocks(self, config: EngineConfig, max_blocks_per_seq: int, device) -> int:
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            per_block = kv_block_bytes(self.model_config, config.block_size, self.kv_dtype)
            if self.mesh is not None and jax.default_backend() != "cpu":
                per_block //= config.tensor_parallel_size  # each device holds its KV heads' share of a block
            budget_blocks = kv_budget_bytes(config.gpu_memory_utilization, device) // per_block
            # More blocks than max_num_seqs full-length sequences can ever use would only waste memory.
            num_blocks = int(min(budget_blocks, config.max_num_seqs * max_blocks_per_seq + 1))
        if num_blocks - 1 < max_blocks_per_seq:
            raise ValueError(
                f"the KV pool has {num_blocks - 1} usable blocks of {config.block_size} tokens, fewer than one "
                f"sequence of max_model_len={config.max_model_len} needs ({max_blocks_per_seq}); raise "
                "num_kv_blocks (or the memory budget) or lower max_model_len")
        return num_blocks

    # ---- requests -------------------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                     params: SamplingParams) -> ParentRequest:
        """Tokenizes and validates one request without touching engine state (raises ValueError)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass prompt_token_ids")
            prompt_token_ids = text_token_ids(self.tokenizer, prompt)
        prompt_token_ids = list(prompt_token_ids)
        vocab = self.model_config.vocab_size
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if not all(isinstance(t, (int, np.integer)) and 0 <= t < vocab for t in prompt_token_ids):
            bad = next(t for t in prompt_token_ids if not (isinstance(t, (int, np.integer)) and 0 <= t < vocab))
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, which leaves no room to generate "
                             f"within max_model_len={self.config.max_model_len}")
        params.check_vocab(vocab)
        if params.n > self.config.max_num_seqs:
            raise InvalidParameter("n", f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        constraint = params.structured_outputs  # compiled (or found cached) by the first sample's matcher below
        if constraint is not None and self.grammars is None:
            raise ValueError("structured_outputs needs a tokenizer; this engine has none")
        length_limit = self.config.max_model_len
        if params.max_tokens is not None:
            length_limit = min(length_limit, len(prompt_token_ids) + params.max_tokens)
        children = []
        for index in range(params.n):
            # Each sample gets its own stream: seed + index when seeded (as vLLM does), else a fresh draw.
            seed = (params.seed + index) % 2**32 if params.seed is not None else int(self._seed_rng.integers(2**32))
            detokenizer = (IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
                           if self.tokenizer is not None else None)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            children.append(Request(child_id, prompt, [int(t) for t in prompt_token_ids], params, seed,
                                    detokenizer, self.eos_token_ids, index=index, length_limit=length_limit,
                                    grammar=self.grammars.matcher(constraint) if constraint is not None else None))
        return ParentRequest(request_id, children)

    def add_request(self, request: ParentRequest) -> None:
        self.requests[request.request_id] = request
        self.num_constrained_requests += request.leader.grammar is not None
        self.scheduler.add(request.leader)

    def abort_request(self, request_id: str) -> None:
        parent = self.requests.pop(request_id, None)
        if parent is None:
            return
        parent.pending_forks = []
        for child in parent.children:
            if not child.finished:
                self.scheduler.finish(child, "abort")

    def has_unfinished_requests(self) -> bool:
        # A step still in flight holds only requests that are running (or finished: its rows are discarded).
        return self.scheduler.has_unfinished()

    # ---- the step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns outputs of the requests that produced a token.

        An exception while scheduling, preparing, running or postprocessing fails only the requests of the
        step (and of the step in flight): they are aborted, their blocks freed, and `StepFailedError` names
        them; the engine serves the next step as before. If the KV pool itself was lost (a device failure
        after the pool was donated), the engine cannot go on: `EngineBrokenError`.

        With `async_scheduling` (the default) the step launched by the previous call is still running on the
        device while this one is scheduled, prepared and launched (its rows read the tokens still in flight
        on the device); then the previous step is postprocessed and its outputs returned. Host work thus
        overlaps device work, and outputs come back one call after their step was launched. Without it:
        schedule -> prepare -> run -> postprocess, and the outputs are this step's. Tokens are the same.
        """
        if not self.is_leader:
            raise RuntimeError("this process follows process 0 in a multi-host run: call follow(), not step()")
        previous, self._in_flight = self._in_flight, None
        try:
            return self._step(previous)
        except Exception as exc:  # noqa: BLE001 - isolated below: only this step's requests pay for it
            return self._fail_step(exc, previous, self._scheduled)

    def _step(self, previous: "_InFlight | None") -> list[RequestOutput]:
        self._scheduled = None
        outputs = []
        if previous is not None and previous.reads_back:
            # Penalties count a request's tokens on the host, and a grammar's next mask depends on its last
            # token: such a request's token in flight must be read before it is scheduled again.
            outputs, previous = self._postprocess(previous), None
        t0 = time.perf_counter()
        batch = self._scheduled = self.scheduler.schedule()
        t1 = time.perf_counter()
        record = None
        if self._trace is not None and batch:  # read before the launch advances the rows' counts
            record = record_step(self._trace, batch, self.block_manager.num_used_blocks)
        launched = self._launch(batch, previous) if batch else None
        t2 = time.perf_counter()
        if record is not None:
            record.scheduled_at, record.schedule_s, record.launch_s = t0 - self._trace.origin, t1 - t0, t2 - t1
            launched.record, launched.trace_origin = record, self._trace.origin
        self.step_timings["schedule"] += t1 - t0
        self.step_timings["prepare"] += t2 - t1
        if previous is not None:
            outputs += self._postprocess(previous)
        if launched is not None:
            if self.config.async_scheduling:
                self._in_flight = launched
            else:
                outputs += self._postprocess(launched)
        return outputs

    def _fail_step(self, error: Exception, previous: "_InFlight | None", batch: ScheduledBatch | None) -> NoReturn:
        self._in_flight = None
        if not self.runner.pool_is_intact():
            raise EngineBrokenError(f"the KV cache was lost in a failed step: {type(error).__name__}: {error}") \
                from error
        failed = {}
        for scheduled in (previous.batch if previous is not None else None, batch):
            for request in scheduled.requests if scheduled is not None else ():
                failed.setdefault(request.parent.request_id, request.parent)
        for request_id in failed:
            self.abort_request(request_id)
        logger.error("a step failed (%s: %s); its requests %s were aborted", type(error).__name__, error,
                     sorted(failed))
        raise StepFailedError(sorted(failed), error) from error

    def _launch(self, batch: ScheduledBatch, previous: "_InFlight | None") -> "_InFlight":
        """Prepares and launches `batch`; advances each request's computed tokens, and gives each request
        whose sample is a real next token a PLACEHOLDER for it (filled by _postprocess)."""
        self.num_computed_prompt_tokens += sum(batch.prompt_tokens_per_row())
        inputs = prepare_inputs(batch, self.block_manager, self.buckets)
        out, tokens = self.runner.launch(inputs, previous.tokens if previous is not None else None)
        token_index = []
        reads_back = False
        for row, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            request.num_computed_tokens += num_new
            if request.num_computed_tokens < request.num_tokens:
                token_index.append(-1)  # a prefill chunk: its sample is not a real next token
                continue
            token_index.append(request.num_tokens)
            request.token_ids.append(PLACEHOLDER)
            request.placeholder_row = row
            reads_back = reads_back or request.params.has_penalties or request.grammar is not None
        return _InFlight(batch, token_index, out, tokens, reads_back)

    def _postprocess(self, flight: "_InFlight") -> list[RequestOutput]:
        t0 = time.perf_counter()
        sampled = self.runner.fetch(flight.out)  # waits for the device: only token ids come back
        t1 = time.perf_counter()
        touched: dict[str, ParentRequest] = {}
        copies = []
        for i, (request, index) in enumerate(zip(flight.batch.requests, flight.token_index)):
            if request.finished:
                continue  # stopped or aborted while this step ran: its row is discarded
            if index >= 0:
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
            if request.logprobs is not None:
                self._record_logprobs(request, sampled, i)
            self._accept_token(request, index)
            if request.finished and request.detokenizer is not None and not isinstance(request.stop_reason, str):
                request.text += request.detokenizer.flush()
            touched[parent.request_id] = parent
        # Copy-on-write before anything can reuse a source block (a finished leader frees its blocks).
        self.mover.copy(copies)
        outputs = []
        for parent in touched.values():
            outputs.append(self.output_of(parent))
            if parent.finished:
                self.requests.pop(parent.request_id, None)
        timings = self.step_timings
        timings["device"] += t1 - t0
        if flight.record is not None:
            flight.record.read_back_at = t1 - flight.trace_origin
            flight.record.device_wait_s = t1 - t0
            flight.record.postprocess_s = time.perf_counter() - t1
        # Decode-only steps (every sequence computes one token) are bound by reading the weights and the
        # K/V; steps carrying prompt chunks by compute. Keeping them apart shows which one limits a run.
        decode_only = flight.batch.total_tokens == len(flight.batch.requests)
        timings["device_decode_only" if decode_only else "device_with_prefill"] += t1 - t0
        timings["postprocess"] += time.perf_counter() - t1
        timings["steps"] += 1
        return outputs

    def _record_logprobs(self, request: Request, sampled: SamplerOutput, row: int) -> None:
        token = int(sampled.tokens[row])
        logprob = float(sampled.token_logprobs[row])
        entry = {token: Logprob(logprob, int(sampled.token_ranks[row]), self._decode_one(token))}
        for rank, (tid, lp) in enumerate(zip(sampled.top_ids[row, :request.params.logprobs],
                                             sampled.top_logprobs[row, :request.params.logprobs]), start=1):
            entry.setdefault(int(tid), Logprob(float(lp), rank, self._decode_one(int(tid))))
        request.logprobs.append(entry)
        request.cumulative_logprob += logprob

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
        if request.grammar is not None:
            if not request.grammar.accept(token):  # only if every token was masked (e.g. min_tokens vs. EOS)
                logger.warning("request %s: its grammar rejected token %d (%s)", request.request_id, token,
                               request.grammar.error)
                return self.scheduler.finish(request, "abort")
            grammar_done = request.grammar.is_terminated
        num_out = index + 1 - request.num_prompt_tokens
        if num_out >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                return self.scheduler.finish(request, "stop")
            if token in params.stop_token_ids:
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

    def output_of(self, parent: ParentRequest) -> RequestOutput:
        completions = [CompletionOutput(index=c.index, text=c.text, token_ids=c.output_token_ids,
                                        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                        cumulative_logprob=c.cumulative_logprob,
                                        logprobs=list(c.logprobs) if c.logprobs is not None else None)
                       for c in parent.children]
        leader = parent.leader
        finished = parent.finished
        metrics = RequestMetrics(leader.arrival_time, leader.first_scheduled_time, leader.first_token_time,
                                 time.monotonic() if finished else None)
        return RequestOutput(request_id=parent.request_id, prompt=leader.prompt,
                             prompt_token_ids=leader.prompt_token_ids, outputs=completions,
                             finished=finished, num_cached_tokens=leader.num_cached_tokens or 0, metrics=metrics)

    def precompile(self, show_progress: bool = False) -> None:
        """Compiles every (tokens, seqs) bucket ahead of traffic by running all-padding steps."""
        from paged.models.progress import progress
        shapes = self.buckets.all_shapes()
        started, (hits, misses) = time.perf_counter(), startup.compilation_cache_counts()
        for t_pad, _ in progress(shapes, desc="Compiling", disable=not show_progress):
            self.runner.run(padding_inputs(self.block_manager, self.buckets, t_pad))
        now_hits, now_misses = startup.compilation_cache_counts()
        startup.log_precompiled(len(shapes), time.perf_counter() - started, now_hits - hits, now_misses - misses,
                                self.compilation_cache_dir)

    # ---- tracing --------------------------------------------------------------------------------------

    def start_trace(self) -> EngineTrace:
        """Records every step from now on (paged/trace.py); a trace already running is replaced."""
        self._trace = EngineTrace()
        return self._trace

    def stop_trace(self) -> EngineTrace:
        """Ends the trace and returns it (a step still in flight keeps its record's device fields empty)."""
        if self._trace is None:
            raise RuntimeError("no trace is running: call start_trace() first")
        trace, self._trace = self._trace, None
        return trace

    # ---- several hosts --------------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True unless this process is a follower of a multi-host run (paged/multihost.py)."""
        return self.channel is None or self.channel.leader

    def stop_followers(self) -> None:
        """On a multi-host leader: tells the followers the run is over (also done at exit). Nothing else."""
        if self.channel is not None and self.channel.leader:
            self.channel.stop()

    def follow(self) -> None:
        """On a follower: runs the leader's device operations, in its order, until the leader stops."""
        if self.is_leader:
            raise RuntimeError("follow() is for the followers of a multi-host run; this process leads")
        tokens = None  # the padded samples of the last step launched here, as on the leader
        while True:
            op, payload = self.channel.receive()
            if op == "launch":
                inputs, chained = payload
                _, tokens = self.runner.launch(inputs, tokens if chained else None)
            elif op == "copy":
                self.mover.copy(payload)
            elif op == "stop":
                logger.info("the leader stopped the run")
                return
            else:
                raise RuntimeError(f"unknown operation {op!r} from the leader: the processes run different code")

    # ---- introspection --------------------------------------------------------------------------------

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def kv_stats(self, include_utilization: bool = True) -> dict:
        """Memory accounting for metrics and benchmarks.

        kv_cache_usage: used / usable blocks. With include_utilization (O(blocks held), so off for per-step
        metrics): kv_utilization, token slots holding live K/V / token slots in the blocks that running
        requests hold (waste is the unfilled tail of each sequence's last block).
        """
        bm = self.block_manager
        running = self.scheduler.running
        stats = {
            "num_blocks": bm.num_usable_blocks,
            "num_used_blocks": bm.num_used_blocks,
            "kv_cache_usage": bm.num_used_blocks / bm.num_usable_blocks,
            "num_running": len(running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swaps": self.scheduler.num_swaps,
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "blocks_released_outside_window": bm.num_window_freed,
        }
        if include_utilization:
            held = {b for r in running for b in r.block_ids} - {SINK_BLOCK}
            live = bm.live_token_slots(running)
            stats["num_held_blocks"] = len(held)
            stats["kv_utilization"] = live / (len(held) * bm.block_size) if held else 1.0
        return stats


@dataclasses.dataclass
class _InFlight:
    """A launched step: its batch, where each row's sample goes (index into the request's token_ids, -1 for
    a prefill chunk), and its device outputs."""

    batch: ScheduledBatch
    token_index: list[int]
    out: SamplerOutput
    tokens: jax.Array  # int32 [max_num_seqs]: the samples, for the next step to read on the device
    reads_back: bool  # a request with penalties or a grammar has a token in flight: read it before scheduling
    record: StepRecord | None = None  # its entry in the engine trace, while one is recorded
    trace_origin: float = 0.0  # that trace's time zero (perf_counter)


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"could not load a tokenizer from {path!r}: {type(exc).__name__}: {exc}") from exc
