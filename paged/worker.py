"""The device side of one engine, built ready for it: devices and mesh, the weights, the KV pool sized to its
memory budget, the jitted step and block moves, compilation ahead of traffic, and on a multi-host follower the
replay of the leader's operations. The engine above it only schedules and processes outputs."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from paged import multihost, startup
from paged.batch import Buckets, StepInputs, padding_inputs, prompt_logprob_rows
from paged.config import KV_CACHE_DTYPES, EngineConfig
from paged.draft_model import proposer_block_bytes
from paged.logit_adjustments import build_adjustments
from paged.models import get_attention_backend, load_model
from paged.models.attention import resolve_backends
from paged.models.layers import unrolled_layers
from paged.models.linear import GREEDY_SCREEN
from paged.models.config import ModelConfig
from paged.models.eagle import eagle3_aux_layers
from paged.lora import LoRAAdapter, LoRARequest, read_peft_adapter
from paged.lora_weights import match_adapter, placement_of, with_lora_of, without_lora, write_slot
from paged.models.loader import parameter_shapes, saved_layout, weight_bytes
from paged.models.orbax_checkpoint import save_checkpoint, stacked, unstacked
from paged.parallel import ShardedAttention, make_mesh, placement, replica_devices
from paged.runner import BlockMover, ModelRunner, kv_block_bytes, kv_budget
from paged.sampler import SamplerOutput
from paged.speculative import max_verify_tokens

logger = logging.getLogger(__name__)


def kv_cache_dtype(option: str, model_dtype) -> np.dtype:
    """The KV pool's dtype for the `kv_cache_dtype` option: the model's for "auto"."""
    name = KV_CACHE_DTYPES[option]
    return np.dtype(model_dtype if name is None else jnp.dtype(name))


class Worker:
    def __init__(self, model_dir: str, model_config: ModelConfig, config: EngineConfig,
                 channel: multihost.StepChannel | None = None, show_progress: bool = True,
                 pooling: tuple[str, bool] | None = None):
        """`config` is resolved against the model (max_model_len set); `channel` joins a multi-host run's
        processes (the leader publishes each device operation, a follower replays them in `follow`);
        `pooling`: a pooling model's (pooling type, classifier head?), see ModelRunner."""
        platform = jax.default_backend()
        self.channel = channel
        self.devices = devices = replica_devices(config.tensor_parallel_size, config.data_parallel_size,
                                                 config.data_parallel_rank)
        self.mesh = make_mesh(config.tensor_parallel_size, model_config.num_heads, model_config.num_kv_heads,
                              devices)
        # A single-device replica other than the first commits its arrays to its own device (jitted steps then
        # run there); on the default device nothing changes.
        self.device = devices[0] if self.mesh is None and devices[0] != jax.devices()[0] else None
        self.lora = config.lora_config()
        self.speculative = config.parsed_speculative_config()
        if channel is not None:
            if self.lora is not None:  # a slot's writes would have to reach every process
                raise NotImplementedError("LoRA adapters do not run over several processes yet")
            if config.speculative_config is not None:
                raise NotImplementedError("speculative decoding does not run over several processes yet")
            if config.preemption_mode == "swap":  # the leader holds only its own heads' K/V to swap out
                raise NotImplementedError("preemption_mode='swap' does not run over several processes yet")
            multihost.check_same_run(channel, multihost.fingerprint(config, model_config))
        self.attention_name, self.linear_backend = resolve_backends(
            platform, config.attention_backend, config.linear_backend, sharded=self.mesh is not None)
        attention = get_attention_backend(self.attention_name, platform)
        unroll = unrolled_layers(config.layer_loop, platform)
        self.model_dir, self.model_config, self.model, params, self.dtype = load_model(
            model_dir, config.dtype, show_progress, stacked_layers=not unroll, linear_backend=self.linear_backend,
            mesh=self.mesh, quantization=config.quantization, device=self.device,
            kv_cache_scales=config.kv_cache_dtype.startswith("fp8"), hf_overrides=config.parsed_hf_overrides(),
            lora=self.lora, load_format=config.load_format)
        # What every parameter's shape is (LoRA adapters are checked against it when they are read).
        self.expected_params = parameter_shapes(self.model)
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        check = None if model_config.encoder_only else getattr(attention, "check_model", None)  # its own attention
        if check is not None:  # refused now, not at the first trace
            check(self.model_config, self.dtype, self.kv_dtype, config.block_size)
        if self.mesh is not None:
            attention = ShardedAttention(attention, self.mesh)
        # Bytes of the weights by dtype (int8, uint8 for packed int4, the float dtype for the rest) and total.
        self.weight_bytes = weight_bytes(params)

        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        self.num_blocks = self._num_blocks(config)
        precomputed = self.model.precomputed(config.max_model_len)
        # The greedy head's screen: one device's kernel (sharded tables keep the full head); pooling models
        # have no LM head to screen.
        self.screens_head = (config.greedy_head_screen and self.mesh is None and channel is None
                             and pooling is None)
        if self.screens_head:
            precomputed.update(self.model.head_screen(params))
        # Tables beside the weights: not saved or updated.
        self.precomputed_keys = frozenset(precomputed) | ({GREEDY_SCREEN} if self.screens_head else set())
        self.load_options = dict(dtype=config.dtype, stacked_layers=not unroll, linear_backend=self.linear_backend,
                                 mesh=self.mesh, quantization=config.quantization, device=self.device,
                                 kv_cache_scales=config.kv_cache_dtype.startswith("fp8"),
                                 hf_overrides=config.parsed_hf_overrides(), lora=self.lora)
        if (where := placement(self.mesh, self.device)) is not None:  # beside the weights, not copied per step
            precomputed = jax.device_put(precomputed, where)
        method = self.speculative.method if self.speculative is not None else None
        self.runner = ModelRunner(self.model, {**params, **precomputed}, attention, self.num_blocks,
                                  config.block_size, self.kv_dtype, config.max_num_seqs, self.mesh, self.device,
                                  publish=channel.publish if channel is not None and channel.leader else None,
                                  pooling=pooling, max_verify_tokens=max_verify_tokens(self.speculative, config.max_num_seqs),
                                  keep_hidden=method in ("eagle", "eagle3"), aux_layers=eagle3_aux_layers(
                                      self.speculative.model, self.model_config.num_layers) if method == "eagle3" else ())
        block_bytes = kv_block_bytes(self.model_config, config.block_size, self.kv_dtype)
        self.kv_pool_bytes = self.num_blocks * block_bytes  # K and V over all layers, every device's share
        swap_blocks = int(config.swap_space * 2**30) // block_bytes if config.preemption_mode == "swap" else 0
        self.mover = BlockMover(self.runner, config.block_size, swap_blocks)

    def _num_blocks(self, config: EngineConfig) -> int:
        """The KV pool's size in blocks: `num_kv_blocks`, else what the memory budget holds (never more than
        max_num_seqs full-length sequences use); on several hosts, what the tightest process holds."""
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
            self.kv_budget_note = f"num_kv_blocks={num_blocks}"
        else:
            per_block = kv_block_bytes(self.model_config, config.block_size, self.kv_dtype)
            if self.mesh is not None and jax.default_backend() != "cpu":
                per_block //= config.tensor_parallel_size  # each device holds its KV heads' share of a block
            # A draft model or EAGLE head keeps its own pool of as many blocks (on one device).
            per_block += proposer_block_bytes(self.speculative, self.model_config, config.block_size, config.dtype,
                                              self.dtype)
            # The budget is read on one of this process's own devices (a multi-host mesh also holds others').
            local = next((d for d in self.devices if d.process_index == jax.process_index()), self.devices[0])
            budget, self.kv_budget_note = kv_budget(config.gpu_memory_utilization, config.kv_cache_memory_bytes,
                                                    local)
            budget_blocks = budget // per_block if per_block else budget  # an encoder's blocks hold nothing
            full = config.max_num_seqs * self.max_blocks_per_seq + 1
            if budget_blocks > full:
                self.kv_budget_note += "; capped at max_num_seqs x max_model_len"
            num_blocks = int(min(budget_blocks, full))
        if self.channel is not None:
            num_blocks = int(multihost_utils.process_allgather(np.int32(num_blocks)).min())
        if num_blocks - 1 < self.max_blocks_per_seq:
            block_bytes = kv_block_bytes(self.model_config, config.block_size, self.kv_dtype)
            fits = (num_blocks - 1) * config.block_size
            raise ValueError(
                f"the KV pool has {num_blocks - 1} usable blocks of {config.block_size} tokens, fewer than one "
                f"sequence of max_model_len={config.max_model_len} needs ({self.max_blocks_per_seq}; the pool was "
                f"sized by {self.kv_budget_note}). One such sequence needs kv_cache_memory_bytes >= "
                f"{(self.max_blocks_per_seq + 1) * block_bytes:,}; this pool fits max_model_len <= {fits}. Raise "
                "num_kv_blocks or kv_cache_memory_bytes (or the memory budget) or lower max_model_len")
        return num_blocks

    # ---- what the engine runs -------------------------------------------------------------------------

    def launch(self, inputs: StepInputs, previous_tokens: jax.Array | None) -> tuple[SamplerOutput, jax.Array]:
        """Starts one step (ModelRunner.launch): its sampler output on the device, and its padded samples."""
        return self.runner.launch(inputs, previous_tokens)

    def fetch(self, out: SamplerOutput) -> SamplerOutput:
        """Waits for a launched step: its samples (token ids, requested logprobs) as host arrays."""
        return self.runner.fetch(out)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of whole blocks in the pool (forks of n > 1)."""
        self.mover.copy(pairs)

    def pool_is_intact(self) -> bool:
        return self.runner.pool_is_intact()

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

    def precompile(self, buckets: Buckets, block_manager, cache_dir: str | None, show_progress: bool = False
                   ) -> None:
        """Compiles every (tokens, seqs) bucket ahead of traffic by running all-padding steps, each with its
        prompt logprobs, and every (rows, entries) shape of the rows a request adjusts
        (paged/logit_adjustments.py) on empty rows."""
        from paged.models.progress import progress
        shapes = buckets.all_shapes()
        adjustment_shapes = buckets.adjustment_shapes()
        started, (hits, misses) = time.perf_counter(), startup.compilation_cache_counts()
        if self.runner.pooling is not None:  # a pooling step has no logprobs or sampling programs
            adjustment_shapes = []
        for t_pad, _ in progress(shapes, desc="Compiling", disable=not show_progress):
            padding = padding_inputs(block_manager, buckets, t_pad)
            if self.runner.pooling is not None:
                self.runner.run(padding)
                continue
            prompt_rows = np.zeros(prompt_logprob_rows(t_pad), np.int32)
            self.runner.run(dataclasses.replace(padding, prompt_logprob_indices=prompt_rows,
                                                prompt_logprob_targets=prompt_rows))
        step = padding_inputs(block_manager, buckets, shapes[0][0])
        for num_rows, num_entries in progress(adjustment_shapes, desc="Compiling sampling", disable=not show_progress):
            adjustments = build_adjustments([], step.sampling, buckets.adjusted_width, buckets.mask_words,
                                            num_rows, num_entries)
            self.runner.run(dataclasses.replace(step, adjustments=adjustments))
        if self.lora is not None:  # the slot writers, on an empty slot (every slot is empty before traffic)
            write_slot(self.runner.params, self.expected_params, 0, {})
        now_hits, now_misses = startup.compilation_cache_counts()
        startup.log_precompiled(len(shapes), len(adjustment_shapes), time.perf_counter() - started,
                                now_hits - hits, now_misses - misses, cache_dir)

    # ---- LoRA adapters --------------------------------------------------------------------------------

    def read_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The PEFT adapter `request` names, read into host memory with its factors matched to this model's
        projections (paged/lora_weights.py); ValueError naming what does not fit."""
        adapter = read_peft_adapter(request.lora_name, request.lora_path, self.lora.max_lora_rank)
        return dataclasses.replace(adapter, modules=match_adapter(adapter, self.model, self.expected_params))

    def write_adapter(self, slot: int, adapter: LoRAAdapter) -> None:
        """Puts `adapter` (read_adapter's) into device slot `slot` of every adapted projection."""
        write_slot(self.runner.params, self.expected_params, slot, adapter.modules)

    # ---- weights and memory ---------------------------------------------------------------------------

    @property
    def params(self) -> dict:
        """The weights the model runs on (quantized codes and all), without the precomputed tables and the LoRA
        slots."""
        return without_lora({k: v for k, v in self.runner.params.items() if k not in self.precomputed_keys})

    def save(self, path: str, tokenizer=None) -> None:
        """The weights as an Orbax checkpoint with the model's config and tokenizer (models/orbax_checkpoint.py)."""
        layout = saved_layout(self.model_config, self.dtype, self.mesh)
        save_checkpoint(path, self.params, self.model_dir, layout, tokenizer)

    def update_weights(self, new: dict | str) -> None:
        """Replaces the weights in place: a tree in the model's layout (`params`; layers stacked or a list of
        layers, either), or a checkpoint path loaded with this engine's settings. Each array goes where the one
        it replaces is, with its shape and dtype, so nothing recompiles; a mismatch is a ValueError naming it
        before anything changes."""
        if isinstance(new, (str, os.PathLike)):
            new = load_model(str(new), show_progress=False, **self.load_options)[3]
        current = self.params
        if "layers" in new:  # either layout of the layers, as this engine holds them
            unrolled = isinstance(current.get("layers"), list)
            new = unstacked(new) if unrolled and not isinstance(new["layers"], list) else \
                stacked(new) if not unrolled else new
        want, got = jax.tree_util.tree_structure(current), jax.tree_util.tree_structure(new)
        if want != got:
            raise ValueError(f"the new weights' tree differs from the model's: expected {want}, got {got}")
        for (path, old), leaf in zip(jax.tree_util.tree_flatten_with_path(current)[0], jax.tree.leaves(new)):
            if tuple(leaf.shape) != old.shape or np.dtype(leaf.dtype) != old.dtype:
                raise ValueError(f"{jax.tree_util.keystr(path)}: expected {old.dtype}{list(old.shape)}, got "
                                 f"{np.dtype(leaf.dtype)}{list(leaf.shape)}")
        new = without_lora(new)
        # Each array placed as the one it replaces (uncommitted ones stay uncommitted: a step mixing the two
        # leaves jit's fast dispatch path).
        placed = jax.tree.map(lambda old, leaf: jax.device_put(leaf, placement_of(old)), current, new)
        # The adapters in the LoRA slots stay where they are; the greedy head's screen is rebuilt from the new
        # table (a stale one would give the old table's tokens).
        merged = with_lora_of({**self.runner.params, **placed}, self.runner.params)
        if self.screens_head:
            merged.pop(GREEDY_SCREEN, None)  # (a table that is no longer finite has none)
            screen = self.model.head_screen(merged)
            where = placement(self.mesh, self.device)
            merged.update(screen if where is None else jax.device_put(screen, where))
        self.runner.params = merged

    def sleep(self) -> None:
        """Releases the KV pool's device memory (its contents are lost); `wake_up` allocates it again."""
        self.runner.release_pool()

    def wake_up(self) -> None:
        self.runner.allocate_pool()

    # ---- several hosts --------------------------------------------------------------------------------

    def follow(self) -> None:
        """On a follower: runs the leader's device operations, in its order, until the leader stops."""
        tokens = None  # the padded samples of the last step launched here, as on the leader
        while True:
            op = self.channel.receive()
            if isinstance(op, multihost.Launch):
                _, tokens = self.runner.launch(op.inputs, tokens if op.chained else None)
            elif isinstance(op, multihost.CopyBlocks):
                self.mover.copy(op.pairs)
            elif isinstance(op, multihost.Stop):
                logger.info("the leader stopped the run")
                return
            else:
                raise RuntimeError(f"unexpected operation {op!r} from the leader: the processes run different code")
