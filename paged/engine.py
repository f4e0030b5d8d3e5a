"""LLMEngine: requests in, outputs out; each `step()` is schedule -> prepare -> run -> postprocess."""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

from models import get_attention_backend, load_model
from paged.batch import Buckets, padding_inputs, prepare_inputs
from paged.block_manager import BlockManager
from paged.config import EngineConfig
from paged.detokenizer import IncrementalDetokenizer, find_stop_string
from paged.outputs import CompletionOutput, RequestOutput
from paged.request import Request, RequestStatus
from paged.runner import ModelRunner, kv_block_bytes, kv_budget_bytes
from paged.sampling_params import SamplingParams
from paged.scheduler import ScheduledBatch, Scheduler

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: str, tokenizer: str | None = None, dtype: Any = "auto",
                 tensor_parallel_size: int = 1, quantization: str | None = None, show_progress: bool = True,
                 **engine_args):
        if tensor_parallel_size != 1:
            raise NotImplementedError("tensor_parallel_size > 1 is not implemented yet")
        if quantization is not None:
            raise NotImplementedError(f"quantization={quantization!r} is not implemented yet")
        config = EngineConfig(**engine_args)
        config.validate()
        attention = get_attention_backend(config.attention_backend, jax.default_backend())

        from models.tiny import TINY_MODEL_NAME, default_tiny_model_dir
        if model == TINY_MODEL_NAME:
            model = default_tiny_model_dir()
        model_dir, self.model_config, self.model, params, self.dtype = load_model(model, dtype, show_progress)
        self.config = config = config.resolved(self.model_config.max_position_embeddings)
        self.tokenizer = _load_tokenizer(tokenizer or model_dir)
        eos = self.model_config.eos_token_ids
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        self.eos_token_ids: tuple[int, ...] = eos

        max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        num_blocks = self._num_blocks(config, max_blocks_per_seq)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.max_num_seqs, max_blocks_per_seq)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill)
        self.buckets = Buckets(config.max_num_batched_tokens, config.max_num_seqs, max_blocks_per_seq)
        self.runner = ModelRunner(self.model, params, attention, num_blocks, config.block_size, self.dtype)
        self.requests: dict[str, Request] = {}
        self._seed_rng = np.random.default_rng(config.seed)

    def _num_blocks(self, config: EngineConfig, max_blocks_per_seq: int) -> int:
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            per_block = kv_block_bytes(self.model_config, config.block_size, self.dtype)
            budget_blocks = kv_budget_bytes(config.gpu_memory_utilization) // per_block
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
                     params: SamplingParams) -> Request:
        """Tokenizes and validates one request without touching engine state (raises ValueError)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
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
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids {params.stop_token_ids} include ids outside the vocabulary [0, {vocab})")
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**32))
        detokenizer = (IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
                       if self.tokenizer is not None else None)
        return Request(request_id, prompt, [int(t) for t in prompt_token_ids], params, seed, detokenizer,
                       self.eos_token_ids)

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None and not request.finished:
            self.scheduler.finish(request, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns outputs of the requests that produced a token in it."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        inputs = prepare_inputs(batch, self.block_manager, self.buckets)
        sampled = self.runner.run(inputs)
        return self._postprocess(batch, sampled)

    def _postprocess(self, batch: ScheduledBatch, sampled: np.ndarray) -> list[RequestOutput]:
        outputs = []
        for i, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            request.num_computed_tokens += num_new
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk: its sample is not a real next token
            self._append_token(request, int(sampled[i]))
            if request.finished and request.detokenizer is not None and not isinstance(request.stop_reason, str):
                request.text += request.detokenizer.flush()
            outputs.append(self.output_of(request))
            if request.finished:
                self.requests.pop(request.request_id, None)
        return outputs

    def _append_token(self, request: Request, token: int) -> None:
        params = request.params
        request.token_ids.append(token)
        delta = request.detokenizer.add(token) if request.detokenizer is not None else ""
        request.text += delta
        num_out = request.num_output_tokens
        if num_out >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                return self.scheduler.finish(request, "stop")
            if token in params.stop_token_ids:
                return self.scheduler.finish(request, "stop", token)
            if params.stop and delta:
                match = find_stop_string(request.text, len(delta), params.stop)
                if match is not None:
                    stop, index = match
                    end = index + len(stop) if params.include_stop_str_in_output else index
                    request.text = request.text[:end]
                    return self.scheduler.finish(request, "stop", stop)
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return self.scheduler.finish(request, "length")
        if request.num_tokens >= self.config.max_model_len:
            return self.scheduler.finish(request, "length")

    def output_of(self, request: Request) -> RequestOutput:
        completion = CompletionOutput(index=0, text=request.text, token_ids=list(request.output_token_ids),
                                      finish_reason=request.finish_reason, stop_reason=request.stop_reason)
        return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                             prompt_token_ids=request.prompt_token_ids, outputs=[completion],
                             finished=request.finished, num_cached_tokens=0)

    def precompile(self, show_progress: bool = False) -> None:
        """Compiles every (tokens, seqs, pages) bucket ahead of traffic by running all-padding steps."""
        from tqdm.auto import tqdm
        shapes = self.buckets.all_shapes()
        for t_pad, _, p_pad in tqdm(shapes, desc="Compiling", disable=not show_progress):
            self.runner.run(padding_inputs(self.block_manager, self.buckets, t_pad, p_pad))

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


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"could not load a tokenizer from {path!r}: {type(exc).__name__}: {exc}") from exc
