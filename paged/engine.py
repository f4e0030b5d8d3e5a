"""LLMEngine: requests in, outputs out. Each `step()` is schedule -> run -> process: the scheduler picks the
step's tokens (paged/scheduler.py), the worker runs them on the devices (paged/worker.py), the output processor
turns the samples into RequestOutputs (paged/output_processor.py). With async scheduling the step launched by
the previous call is processed after this one is launched."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import NoReturn

import jax

from paged import compilation_cache, multihost, startup
from paged.batch import Buckets, PromptLogprobSpan, prepare_inputs, prompt_logprob_spans
from paged.block_manager import SINK_BLOCK, BlockManager
from paged.config import EngineConfig, engine_option_names
from paged.grammar import GrammarCompiler
from paged.input_processor import InputProcessor, load_tokenizer
from paged.lora import LoRARequest
from paged.lora_slots import LoRASlots
from paged.models import load_model_config, resolve_model_path
from paged.models.builtin import builtin_model, random_weights_note
from paged.models.pooling_config import is_matryoshka, resolve_pooler
from paged.models.registry import is_pooling_only, load_plugins
from paged.output_processor import OutputProcessor
from paged.outputs import RequestOutput
from paged.pooler import PoolerOutput
from paged.pooling_params import PoolerConfig, PoolingModel, PoolingParams
from paged.request import PLACEHOLDER, ParentRequest
from paged.sampler import SamplerOutput
from paged.sampling_params import SamplingParams
from paged.scheduler import ScheduledBatch, Scheduler
from paged.draft_model import DraftModelProposer
from paged.eagle import EagleProposer
from paged.speculative import SpecDecodeStats, max_verify_tokens, ngram_proposer
from paged.trace import EngineTrace, StepRecord, record_step
from paged.worker import Worker

logger = logging.getLogger(__name__)


ASLEEP = "the engine is asleep (its KV pool is released): call wake_up() first"


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
        self.compilation_cache_dir = compilation_cache.configure(config.compilation_cache_dir)
        started = time.perf_counter()
        load_plugins()  # models registered from outside (PAGED_PLUGINS, entry points)
        builtin = builtin_model(model)  # the demo model and the tiny one are known by name, offline
        model_dir = builtin[0] if builtin else resolve_model_path(model)
        model_config = load_model_config(model_dir, config.parsed_hf_overrides())
        self.runner_type = runner_type(config.runner, model_config.architecture, model_dir)
        self.pooler_config: PoolerConfig | None = None  # a pooling model's settings, resolved
        if self.runner_type == "pooling":
            # Each prompt is pooled whole in one step: a reduction must see every token's hidden state, and
            # neither a chunk boundary nor a cached prefix (whose hidden states are not kept) may hide some.
            config = dataclasses.replace(config, enable_chunked_prefill=False, enable_prefix_caching=False)
            self.pooler_config = resolve_pooler(model_dir, PoolerConfig.parse(config.pooler_config),
                                                model_config.encoder_only)
        if self.runner_type == "pooling" and config.enable_lora:
            raise ValueError("LoRA adapters are served for generation; a pooling model runs without them "
                             "(leave enable_lora off)")
        # What a pooling model's vectors are: a classifier's scores, else embeddings.
        self.pooling_task = None if self.pooler_config is None else "classify" if model_config.labels else "embed"
        self.config = config = config.resolved(model_config.max_context_len, model_config.max_position_embeddings)
        pooling = (None if self.pooler_config is None
                   else (self.pooler_config.pooling_type, self.pooling_task == "classify"))
        self.worker = worker = Worker(model_dir, model_config, config, self.channel, show_progress, pooling)
        # What describes the engine (startup summary, metrics, benchmarks) is the worker's.
        self.model_config, self.dtype, self.kv_dtype = worker.model_config, worker.dtype, worker.kv_dtype
        self.devices, self.mesh = worker.devices, worker.mesh
        self.attention_name, self.linear_backend = worker.attention_name, worker.linear_backend
        self.weight_bytes, self.kv_pool_bytes = worker.weight_bytes, worker.kv_pool_bytes
        self.kv_budget_note = worker.kv_budget_note  # how the pool's size was chosen

        self.tokenizer = load_tokenizer(config.tokenizer or worker.model_dir)
        eos = self.model_config.eos_token_ids
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        grammars = (GrammarCompiler(self.tokenizer, self.model_config.vocab_size, eos,
                                    config.structured_outputs_disable_any_whitespace,
                                    config.structured_outputs_any_whitespace,
                                    config.structured_outputs_additional_properties)
                    if self.tokenizer is not None else None)
        self.inputs = InputProcessor(config, self.model_config.vocab_size, self.tokenizer, eos, grammars,
                                     self.model_config.rope.length_class)
        if self.pooling_task is not None:
            self.inputs.pooling = PoolingModel(model, self.pooling_task, self.model_config.hidden_size,
                                               is_matryoshka(worker.model_dir))
        self.block_manager = BlockManager(worker.num_blocks, config.block_size, config.max_num_seqs,
                                          worker.max_blocks_per_seq, config.enable_prefix_caching)
        self.speculative = speculative = config.parsed_speculative_config()
        if speculative is not None and self.runner_type == "pooling":
            raise ValueError("speculative decoding is for generation; a pooling model does not decode")
        self.draft = None  # the proposer that runs a model (methods "draft_model", "eagle" and "eagle3")
        if speculative is not None and speculative.method == "draft_model":
            self.draft = DraftModelProposer(speculative, config, model_config, self.attention_name,
                                            self.linear_backend, worker.num_blocks, show_progress)
        elif speculative is not None and speculative.method in ("eagle", "eagle3"):
            self.draft = EagleProposer(speculative, config, worker.model, model_config, worker.runner,
                                       self.block_manager, self.attention_name, self.linear_backend,
                                       worker.num_blocks, show_progress)
        self.buckets = Buckets(config.max_num_batched_tokens, config.max_num_seqs,
                               rope_lengths=model_config.rope.length_dependent,
                               vocab_size=model_config.vocab_size, max_model_len=config.max_model_len,
                               max_logit_bias_entries=config.max_logit_bias_entries,
                               max_stop_token_ids=config.max_stop_token_ids, lora=config.enable_lora,
                               max_verify_tokens=max_verify_tokens(speculative, config.max_num_seqs))
        # Which LoRA adapter is in which device slot, and which wait in host memory (None: LoRA is off).
        self.lora_slots = (LoRASlots(worker.lora, worker.read_adapter, worker.write_adapter)
                           if worker.lora is not None else None)
        # Proposals and their verification (paged/speculative.py); counts as vLLM's spec-decode metrics.
        self.spec_stats = SpecDecodeStats(speculative.num_speculative_tokens if speculative else 0)
        recompute_len = model_config.rope_recompute_len
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, worker.mover if worker.mover.swap_blocks else None,
                                   rope_recompute=(recompute_len, model_config.rope.length_class(recompute_len))
                                   if recompute_len is not None else None, lora_slots=self.lora_slots,
                                   propose=(self.draft or ngram_proposer(speculative)) if speculative else None,
                                   speculation_limit=speculative.disable_by_batch_size if speculative else None)
        # When every layer slides, blocks behind the widest window are released as sequences advance.
        windows = self.model_config.layer_windows
        release_window = max(windows) if windows and all(w > 0 for w in windows) else 0
        self.outputs = OutputProcessor(self.scheduler, self.block_manager, self.tokenizer, eos, release_window,
                                       self.spec_stats)
        self.requests: dict[str, ParentRequest] = {}
        self.num_constrained_requests = 0  # requests added with a structured-output constraint
        self.num_computed_prompt_tokens = 0  # prompt tokens actually run through the model (not cache hits)
        # Host wall time per phase of step(), summed: "prepare" includes launching the jitted step, "device" is
        # the wait for its result (with async scheduling, only what the host work did not hide).
        self.step_timings = dict.fromkeys(("schedule", "prepare", "device", "postprocess", "steps",
                                           "device_decode_only", "device_with_prefill"), 0.0)
        self._in_flight: _InFlight | None = None  # the launched step not yet read back (async scheduling)
        self._scheduled: ScheduledBatch | None = None  # what the step under way scheduled (for _fail_step)
        self._trace: EngineTrace | None = None  # per-step records while start_trace() is in effect
        self.sleeping = False  # sleep() released the KV pool
        startup.compilation_cache_counts()  # counts the persistent cache's hits from here on
        self.model_name = model  # as the user named it
        self.model_description = builtin[1] if builtin else random_weights_note(worker.model_dir)  # None for most
        startup.log_summary(self, time.perf_counter() - started)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end a sample (the model's, else the tokenizer's)."""
        return self.outputs.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: tuple[int, ...]) -> None:  # both processors read them
        self.inputs.eos_token_ids = self.outputs.eos_token_ids = tuple(ids)

    @property
    def grammars(self) -> GrammarCompiler | None:
        """The structured-output compiler and its cache (None without a tokenizer)."""
        return self.inputs.grammars

    @grammars.setter
    def grammars(self, grammars: GrammarCompiler | None) -> None:  # data-parallel replicas share one cache
        self.inputs.grammars = grammars

    # ---- requests -------------------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                     params: SamplingParams, cache_salt: str | None = None,
                     tenant: str | None = None, lora_request: LoRARequest | None = None) -> ParentRequest:
        """Tokenizes and validates one request without touching engine state (raises ValueError).
        `cache_salt`: its prefix-cache blocks are shared only with requests of the same salt; `tenant`: whom
        it is accounted to (admission takes tenants' waiting requests in turn); `lora_request`: the LoRA
        adapter it runs with, read now (into host memory) if it is not held already."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.runner_type == "pooling":
            raise ValueError(f"{self.model_name} is a pooling model ({self.pooling_task}): it returns vectors, "
                             "it does not generate (LLM.embed / LLM.classify, or /v1/embeddings, /classify, /score, "
                             "/rerank)")
        if lora_request is not None:
            self.load_adapter(lora_request)
        return self.inputs.make_request(request_id, prompt, prompt_token_ids, params, cache_salt, tenant,
                                        lora_request)

    def load_adapter(self, lora_request: LoRARequest) -> None:
        """Reads a LoRA adapter into host memory (if it is not there already); ValueError when LoRA is off or
        the adapter does not fit this model."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a paged.LoRARequest, got {type(lora_request).__name__}")
        if self.lora_slots is None:
            raise ValueError(f"Got lora_request {lora_request!r} but LoRA is not enabled!")
        self.lora_slots.load(lora_request)

    def remove_adapter(self, lora_name: str) -> bool:
        """Forgets a LoRA adapter (requests running with it finish first); False if it was not loaded."""
        return self.lora_slots is not None and self.lora_slots.remove(lora_name)

    def make_pooling_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                             params: PoolingParams, tenant: str | None = None,
                             token_type_ids: list[int] | None = None) -> ParentRequest:
        """A pooling model's request (its prompt's vector is its output); validated as make_request's.
        `token_type_ids`: an encoder's segment of each token (a sentence pair's 0s then 1s)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.runner_type != "pooling":
            raise ValueError(f"{self.model_name} generates text; it is not a pooling model (start it with "
                             "runner='pooling' to embed with it)")
        return self.inputs.make_pooling_request(request_id, prompt, prompt_token_ids, params, tenant, token_type_ids)

    def add_request(self, request: ParentRequest) -> None:
        if self.sleeping:
            raise RuntimeError(ASLEEP)
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
        if self.sleeping:
            raise RuntimeError(ASLEEP)
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
        if not self.worker.pool_is_intact():
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
        spans = prompt_logprob_spans(batch)
        inputs = prepare_inputs(batch, self.block_manager, self.buckets, spans)
        out, tokens = self.worker.launch(inputs, previous.tokens if previous is not None else None)
        token_index = []
        # A step with proposals is read back before the next is scheduled (how many were accepted decides the
        # next step's tokens); one without them overlaps the next as without speculation.
        reads_back = bool(batch.num_drafts)
        # A draft model reads each row's last token: without it in hand, the next step could not speculate.
        reads_back = reads_back or (self.draft is not None and self.scheduler.may_propose())
        for row, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            request.num_computed_tokens += num_new
            if request.num_computed_tokens < request.num_tokens or request.pooling is not None:
                token_index.append(-1)  # a prefill chunk (its sample is not a real next token), or a pooled row
                continue
            token_index.append(request.num_tokens)
            request.token_ids.append(PLACEHOLDER)
            request.placeholder_row = row
            reads_back = reads_back or request.params.has_penalties or request.grammar is not None
        return _InFlight(batch, token_index, out, tokens, reads_back, spans)

    def _postprocess(self, flight: "_InFlight") -> list[RequestOutput]:
        t0 = time.perf_counter()
        sampled = self.worker.fetch(flight.out)  # waits for the device: only token ids come back
        t1 = time.perf_counter()
        if isinstance(sampled, PoolerOutput):
            processed = self.outputs.process_pooled(flight.batch, sampled.data, self.pooler_config)
        else:
            processed = self.outputs.process(flight.batch, flight.token_index, sampled, flight.prompt_spans)
        self.worker.copy_blocks(processed.block_copies)  # before a freed source block can be reused
        for output in processed.outputs:
            if output.finished:
                self.requests.pop(output.request_id, None)
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
        return processed.outputs

    def precompile(self, show_progress: bool = False) -> None:
        """Compiles every (tokens, seqs) bucket ahead of traffic by running all-padding steps."""
        self.worker.precompile(self.buckets, self.block_manager, self.compilation_cache_dir, show_progress)
        if self.draft is not None:
            self.draft.precompile()

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

    # ---- weights and memory (a training loop's hooks) ---------------------------------------------------

    def save(self, path: str) -> None:
        """Writes the loaded model (its weights as held, config and tokenizer) as an Orbax checkpoint that
        `LLMEngine(path)` restores (models/orbax_checkpoint.py)."""
        if self.channel is not None:
            raise NotImplementedError("saving a multi-host run is not implemented: save from a single-host engine")
        self.worker.save(path, self.tokenizer if self.config.tokenizer else None)

    def get_params(self) -> dict:
        """The weights the model runs on: a tree of device arrays in the model's layout (update_weights')."""
        return self.worker.params

    def update_weights(self, new: dict | str) -> None:
        """Swaps in new weights (a tree shaped as get_params(), or a checkpoint path) on the same devices and
        shardings, without recompiling; the prefix cache is cleared (its K/V came from the old weights)."""
        self._check_idle("update_weights")
        self.worker.update_weights(new)
        self.block_manager.reset_prefix_cache()

    def sleep(self) -> None:
        """Frees the KV pool's device memory (for a trainer sharing the devices); `wake_up` restores it. The
        weights stay. Steps are refused while asleep."""
        self._check_idle("sleep")
        self.worker.sleep()
        self.block_manager.reset_prefix_cache()
        self.sleeping = True

    def wake_up(self) -> None:
        self.worker.wake_up()
        self.sleeping = False

    def _check_idle(self, what: str) -> None:
        if self.has_unfinished_requests() or self._in_flight is not None:
            raise RuntimeError(f"{what} needs an idle engine: finish or abort the running requests first")

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
        self.worker.follow()

    # ---- introspection --------------------------------------------------------------------------------

    @property
    def num_compilations(self) -> int:
        return self.worker.num_compilations + (self.draft.num_compilations if self.draft is not None else 0)

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
    out: SamplerOutput | PoolerOutput
    tokens: jax.Array | None  # int32 [max_num_seqs]: the samples, for the next step to read (None: pooled)
    reads_back: bool  # a request with penalties or a grammar has a token in flight: read it before scheduling
    prompt_spans: list[PromptLogprobSpan]  # where the step's prompt logprobs go
    record: StepRecord | None = None  # its entry in the engine trace, while one is recorded
    trace_origin: float = 0.0  # that trace's time zero (perf_counter)


def runner_type(runner: str, architecture: str, model_dir: str) -> str:
    """"generate" or "pooling" for the `runner` option, as vLLM resolves "auto": pooling for architectures
    without an LM head and for sentence-transformers checkpoints, generation for the rest."""
    pooling_only = is_pooling_only(architecture)
    if runner == "auto":
        sentence_transformers = os.path.exists(os.path.join(model_dir, "modules.json"))
        return "pooling" if pooling_only or sentence_transformers else "generate"
    if runner == "generate" and pooling_only:
        raise ValueError(f"{architecture} has no LM head, it can only pool: use runner='pooling' (or leave runner "
                         "at 'auto')")
    return runner
