"""Owns the device side: parameters, the KV pool, and the jitted step."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from paged.kernels import cpu
from paged.batch import StepInputs
from paged.multihost import CopyBlocks, Launch
from paged.parallel import kv_pool_sharding, placement
from paged.models.linear import LastHidden, lora_token_slots
from paged.logit_adjustments import LogitAdjustments, apply_entries
from paged.pooler import PoolerOutput, pool_tokens
from paged.sampler import (AdjustedSamples, SamplerOutput, SamplingMetadata, apply_token_mask, draw, first_argmax,
                           no_samples, prompt_logprobs, sample)


def kv_block_bytes(model_config, block_size: int, dtype) -> int:
    """Bytes one block takes across all layers, K and V (none for an encoder, which keeps no K/V)."""
    c = model_config
    if c.encoder_only:
        return 0
    return 2 * c.num_layers * c.num_kv_heads * block_size * c.head_dim * np.dtype(dtype).itemsize


# The KV pool a CPU host gets by default (vLLM's CPU backend defaults to 4 GiB as well): a CPU engine shares
# its host with everything else, so it does not take most of the memory unless asked to.
CPU_DEFAULT_KV_BYTES = 4 * 2**30


def host_available_bytes() -> int:
    """What the kernel says could be allocated without swapping: MemAvailable (free pages plus reclaimable
    page cache), so identical runs see the same figure whatever the page cache holds; free pages where
    /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_budget_bytes(memory_utilization: float, device=None) -> int:
    """Bytes available for the KV pool on `device` (default: the first), after what is already allocated
    (weights).

    GPUs report their limit through memory_stats; on CPU the pool lives in host memory, so the budget is a
    fraction of what the OS reports as available.
    """
    stats = (device or jax.devices()[0]).memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"] * memory_utilization) - int(stats.get("bytes_in_use", 0))
    return int(host_available_bytes() * memory_utilization)


def kv_budget(memory_utilization: float, memory_bytes: int | None, device) -> tuple[int, str]:
    """The KV pool's byte budget on `device` and how it was chosen (for the start-up summary): the bytes
    asked for; on CPU, VLLM_CPU_KVCACHE_SPACE (GiB) if set, else the smaller of CPU_DEFAULT_KV_BYTES and
    `memory_utilization` of the host's available memory; elsewhere `memory_utilization` of device memory."""
    if memory_bytes is not None:
        return memory_bytes, f"kv_cache_memory_bytes={memory_bytes:,}"
    if device.platform == "cpu":
        space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
        if space and space != "0":
            try:
                gib = float(space)
            except ValueError:
                raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got {space!r}") from None
            return int(gib * 2**30), f"VLLM_CPU_KVCACHE_SPACE={space} GiB"
        budget = kv_budget_bytes(memory_utilization, device)
        if budget >= CPU_DEFAULT_KV_BYTES:
            return CPU_DEFAULT_KV_BYTES, ("the CPU default of 4 GiB (set kv_cache_memory_bytes or "
                                          "VLLM_CPU_KVCACHE_SPACE for another)")
        return budget, f"{memory_utilization:g} of the host's available memory (under the CPU default of 4 GiB)"
    return kv_budget_bytes(memory_utilization, device), f"gpu_memory_utilization={memory_utilization:g}"


class ModelRunner:
    def __init__(self, model, params, attention, num_blocks: int, block_size: int, dtype, max_num_seqs: int,
                 mesh=None, device=None, publish=None, pooling: tuple[str, bool] | None = None,
                 max_verify_tokens: int = 0, keep_hidden: bool = False, aux_layers: tuple[int, ...] = ()):
        """`mesh`: the tensor-parallel mesh (None: one device); `device`: that one device when it is not the
        default (a data-parallel replica's); `publish(operation)`: on a multi-host leader, hands each device
        operation's host inputs to the followers before it runs (paged/multihost.py); `pooling`: for a pooling
        model, (pooling type, whether the model's classifier head follows): each step then returns pooled rows
        (paged/pooler.py) instead of samples; `max_verify_tokens`: a speculating engine's most verified positions
        in a step (Buckets.max_verify_tokens; 0 without speculation): a step carrying proposals
        (`StepInputs.num_verify`) also draws the token after each, to verify them; `keep_hidden`: every step also
        writes each packed token's final-normed hidden state into `hidden_pool` [num_blocks * block_size, H] at
        its K/V slot, where an EAGLE head (paged/eagle.py) reads the target's features; with `aux_layers` (an
        EAGLE-3 head's), the residual streams entering those layers instead, concatenated [.., len * H]."""
        cfg = model.config
        self.model = model
        self.params = params
        self.attention = attention
        self.mesh = mesh
        self.publish = publish
        # An encoder keeps no K/V between steps: its pool has no layers (its blocks are only bookkeeping).
        shape = (0 if cfg.encoder_only else cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
        # Each device allocates only its KV heads (with a mesh), on the replica's device without one.
        pool = kv_pool_sharding(mesh) if mesh is not None else placement(None, device)
        self._zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=pool)
        self.hidden_pool = None
        self.aux_layers = tuple(aux_layers)
        if keep_hidden:
            width = cfg.hidden_size * max(len(aux_layers), 1)
            self.hidden_pool = jnp.zeros((num_blocks * block_size, width), model.dtype)  # not an fp8 KV dtype
            if (where := placement(mesh, device)) is not None:
                self.hidden_pool = jax.device_put(self.hidden_pool, where)
        self.kv_cache = None
        self.allocate_pool()
        self.num_compilations = 0
        self.max_num_seqs = max_num_seqs
        # Each step's samples padded to one fixed width, so the next step's input of them has one shape; it
        # lives where the step's own samples come back (replicated under a mesh, else a second compile).
        self.no_tokens = jnp.zeros(max_num_seqs, jnp.int32)
        if (where := placement(mesh, device)) is not None:
            self.no_tokens = jax.device_put(self.no_tokens, where)
        # The greedy argmax: the native one on a single CPU device (its FFI call does not run sharded).
        on_cpu = (device or jax.devices()[0]).platform == "cpu"
        self.argmax = cpu.argmax_rows_cpu if mesh is None and on_cpu and cpu.available()[0] else first_argmax
        # The pool is donated: XLA writes the new K/V into the same buffers instead of copying the pool.
        self.pooling = pooling
        self.speculative = max_verify_tokens > 0
        # The hidden states the adjusted rows read: the sampled rows', then the verified positions'.
        self.adjusted_width = max_num_seqs + max_verify_tokens
        self._step = jax.jit(self._step_impl, donate_argnums=(1, 4)) if pooling is None else \
            jax.jit(self._pool_step_impl, donate_argnums=(1,))
        # The rows a request adjusts (paged/logit_adjustments.py) in three small programs: the LM head and the
        # grammar mask (per R), the entries (per R x E: the only product, and the cheapest to compile), the
        # draw (per R).
        self._adjusted_logits = jax.jit(self._adjusted_logits_impl)
        self._apply_entries = jax.jit(self._apply_entries_impl)
        self._draw_adjusted = jax.jit(self._draw_adjusted_impl, donate_argnums=(4,))
        # Prompt logprobs from the step's normed hidden states (per token bucket).
        self._prompt_logprobs = jax.jit(self._prompt_logprobs_impl)

    def _step_impl(self, params, kv_cache, inputs: StepInputs, previous_tokens, hidden_pool=None):
        self.num_compilations += 1  # runs only while tracing, i.e. once per new input shape
        source = inputs.token_source
        token_ids = jnp.where(source >= 0, previous_tokens[jnp.maximum(source, 0)], inputs.token_ids)
        # The LM head runs inside the sampler's branches: a plain-greedy step may take greedy_head's tokens.
        # Every packed token's hidden state comes out of the same final norm as the sampled rows' (a norm is
        # cheap beside the layers): prompt logprobs read theirs from it in a program of their own, so no
        # request option gives this step another shape.
        num_seqs, num_tokens = inputs.logits_indices.shape[0], token_ids.shape[0]
        indices = jnp.concatenate([inputs.logits_indices, jnp.arange(num_tokens, dtype=jnp.int32)])
        with lora_token_slots(inputs.lora_slots):
            if self.aux_layers:
                normed, kv_cache, aux = self.model.hidden_states(params, kv_cache, token_ids, inputs.attention,
                                                                 indices, self.attention, aux_layers=self.aux_layers)
            else:
                normed, kv_cache = self.model.hidden_states(params, kv_cache, token_ids, inputs.attention, indices,
                                                            self.attention)
        last, token_hidden = LastHidden(normed.h[:num_seqs], normed.live_rows), normed.h[num_seqs:]
        # Rows sampled apart still pass through here as plain greedy rows; a step of nothing else skips it.
        out = jax.lax.cond(inputs.sample_in_step,
                           lambda: sample(lambda: self.model.logits(params, last), inputs.sampling, self.argmax,
                                          self.model.greedy_head(params, last)),
                           lambda: no_samples(num_seqs))
        # The sampled rows' final hidden states at the fixed width, for the adjusted rows' own LM head (then the
        # verified positions').
        hidden = jnp.zeros((self.adjusted_width, last.h.shape[1]), last.h.dtype).at[:num_seqs].set(last.h)
        if self.speculative:  # in the step itself: a separate program's dispatch and read cost more on CPU
            verify_hidden = jnp.take(token_hidden, inputs.verify_indices, axis=0)
            out = dataclasses.replace(out, verified=jax.lax.cond(
                inputs.num_verify > 0, lambda: self._verify(params, verify_hidden, inputs),
                lambda: no_samples(inputs.verify_indices.shape[0])))
            hidden = hidden.at[self.max_num_seqs:self.max_num_seqs + verify_hidden.shape[0]].set(verify_hidden)
        if hidden_pool is not None:  # padding writes the sink block's slots, which nothing reads
            kept = jnp.concatenate(list(aux), axis=-1) if self.aux_layers else token_hidden
            hidden_pool = hidden_pool.at[inputs.attention.slot_mapping].set(kept.astype(hidden_pool.dtype))
        return kv_cache, out, self.no_tokens.at[:num_seqs].set(out.tokens), hidden, token_hidden, hidden_pool

    def _verify(self, params, hidden, inputs: StepInputs) -> SamplerOutput:
        """The next token after each verified packed token, drawn as the row would draw it without proposals
        (its own key per output index), with logprobs where asked. Comparing them with the proposals is exact
        rejection sampling for a proposer that puts all its probability on its token: a proposal d is accepted
        with probability p(d), and on rejection the drawn token follows p with d taken out (the residual
        distribution). Greedy rows get the argmax, and every row the tokens it would get unspeculated. `hidden`:
        the verified positions' final hidden states [V, H]; positions a request adjusts are drawn apart
        (`launch`)."""
        logits = self.model.logits(params, LastHidden(hidden, inputs.num_verify))
        return draw(logits, logits, inputs.verify_sampling, self.argmax)

    def _pool_step_impl(self, params, kv_cache, inputs: StepInputs):
        """A pooling model's step: every packed token's final hidden state, reduced per row (and through the
        classifier head where the model has one); no LM head, no sampling."""
        self.num_compilations += 1
        meta = inputs.attention
        every_token = jnp.arange(inputs.token_ids.shape[0], dtype=jnp.int32)
        with lora_token_slots(inputs.lora_slots):
            normed, kv_cache = self.model.hidden_states(params, kv_cache, inputs.token_ids, meta, every_token,
                                                        self.attention)
        pooling_type, head = self.pooling
        pooled = pool_tokens(normed.h, meta.token_seq_ids, meta.query_start, pooling_type)
        if head:
            pooled = self.model.classify(params, pooled)
        return kv_cache, PoolerOutput(pooled)

    def _prompt_logprobs_impl(self, params, token_hidden, indices, targets):
        self.num_compilations += 1
        head = lambda h: self.model.logits(params, LastHidden(h, jnp.int32(h.shape[0])))
        return prompt_logprobs(head, jnp.take(token_hidden, indices, axis=0, mode="clip"), targets)

    def _adjusted_logits_impl(self, params, hidden, rows, num_rows, allowed_tokens):
        self.num_compilations += 1
        h = jnp.take(hidden, rows, axis=0, mode="clip")
        return apply_token_mask(self.model.logits(params, LastHidden(h, num_rows)), allowed_tokens)

    def _apply_entries_impl(self, masked, adjustments: LogitAdjustments):
        self.num_compilations += 1
        return apply_entries(masked, adjustments)

    def _draw_adjusted_impl(self, adjusted, masked, meta: SamplingMetadata, rows, tokens):
        self.num_compilations += 1
        samples = draw(adjusted, masked, meta, self.argmax)
        return samples, tokens.at[rows].set(samples.tokens, mode="drop")

    def sample_adjusted(self, hidden, tokens, adjustments: LogitAdjustments) -> tuple[AdjustedSamples, jax.Array]:
        """Samples a step's adjusted rows from its padded hidden states; writes their tokens into the step's
        padded tokens (what the next step reads)."""
        a = adjustments
        masked = self._adjusted_logits(self.params, hidden, a.rows, a.num_rows, a.allowed_tokens)
        adjusted = self._apply_entries(masked, a)
        samples, tokens = self._draw_adjusted(adjusted, masked, a.sampling, a.rows, tokens)
        if tokens.sharding != self.no_tokens.sharding:  # the next step's input keeps its one placement
            tokens = jax.device_put(tokens, self.no_tokens.sharding)
        return AdjustedSamples(a.rows, samples), tokens

    def launch(self, inputs: StepInputs, previous_tokens: jax.Array | None = None
               ) -> tuple[SamplerOutput, jax.Array]:
        """Starts one step without waiting for it (JAX dispatches asynchronously).

        `previous_tokens` is the padded token array the previous launch returned: the tokens `inputs` marks in
        `token_source` are read from it on the device. Returns the sampler's output (device arrays; `fetch` reads
        them) and this step's padded tokens for the next launch.
        """
        if self.publish is not None:
            self.publish(Launch(inputs, previous_tokens is not None))
        if self.pooling is not None:
            self.kv_cache, pooled = self._step(self.params, self.kv_cache,
                                               dataclasses.replace(inputs, attention=self.attention.prepare(
                                                   inputs.attention), adjustments=None, prompt_logprob_indices=None,
                                                   prompt_logprob_targets=None))
            return pooled, None
        previous = self.no_tokens if previous_tokens is None else previous_tokens
        adjustments, prompt_indices, prompt_targets = (inputs.adjustments, inputs.prompt_logprob_indices,
                                                       inputs.prompt_logprob_targets)
        verify_adjustments = inputs.verify_adjustments
        # The fused step never sees what a request asks for beyond per-row values: those shapes are their own.
        inputs = dataclasses.replace(inputs, attention=self.attention.prepare(inputs.attention), adjustments=None,
                                     prompt_logprob_indices=None, prompt_logprob_targets=None,
                                     verify_adjustments=None)
        self.kv_cache, out, tokens, hidden, token_hidden, self.hidden_pool = self._step(
            self.params, self.kv_cache, inputs, previous, self.hidden_pool)
        if prompt_indices.shape[0]:
            out = dataclasses.replace(out, prompt=self._prompt_logprobs(self.params, token_hidden, prompt_indices,
                                                                        prompt_targets))
        if adjustments is not None:
            adjusted, tokens = self.sample_adjusted(hidden, tokens, adjustments)
            out = dataclasses.replace(out, adjusted=adjusted)
        if verify_adjustments is not None:  # their rows lie past the padded tokens: `tokens` keeps its values
            adjusted, tokens = self.sample_adjusted(hidden, tokens, verify_adjustments)
            rows = verify_adjustments.rows - self.max_num_seqs  # as rows of the verified samples
            out = dataclasses.replace(out, verified=dataclasses.replace(
                out.verified, adjusted=AdjustedSamples(rows, adjusted.samples)))
        return out, tokens

    def allocate_pool(self) -> None:
        """The KV pool, zeroed (at start-up, and to wake up after `release_pool`)."""
        if self.kv_cache is None:
            self.kv_cache = (self._zeros(), self._zeros())

    def release_pool(self) -> None:
        """Frees the KV pool's device buffers; a step before `allocate_pool` is a RuntimeError."""
        if self.kv_cache is not None:
            for cache in self.kv_cache:
                cache.delete()
            self.kv_cache = None

    def pool_is_intact(self) -> bool:
        """False when the KV pool's buffers are gone (donated to a step that then failed) or hold a failed
        computation's result. Waits for the step in flight."""
        if any(cache.is_deleted() for cache in self.kv_cache):
            return False
        try:
            jax.block_until_ready(self.kv_cache)
        except Exception:  # noqa: BLE001 - an error of the step that produced the pool
            return False
        return True

    @staticmethod
    def fetch(out: SamplerOutput | PoolerOutput) -> SamplerOutput | PoolerOutput:
        """Waits for a launched step; its output as host numpy arrays (a sampler's with adjusted rows in place)."""
        host = jax.tree.map(np.asarray, out)
        return host.merged() if isinstance(host, SamplerOutput) else host

    def run(self, inputs: StepInputs) -> SamplerOutput:
        """Runs one step and waits for it; returns the sampler's output as host numpy arrays."""
        return self.fetch(self.launch(inputs)[0])


def _blocks_bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@jax.jit
def _gather_blocks(kv_cache, block_ids):
    return tuple(cache[:, :, block_ids] for cache in kv_cache)


def _block_writers(dtype, mesh):
    """(copy(kv_cache, src, dst), scatter(kv_cache, dst, data)) over the pool, jitted with it donated.

    16-bit pools on CPU move through the native calls (per shard under a mesh: a block is every head's rows,
    and each shard holds its own heads), because XLA's CPU scatter would convert the whole pool to float32 and
    back; everything else through XLA's scatter.
    """
    if cpu.writes_pool_natively(dtype):
        copy = lambda kc, vc, src, dst: cpu.copy_blocks_cpu(kc, vc, src, dst)
        scatter = lambda kc, vc, dst, kd, vd: cpu.scatter_blocks_cpu(kc, vc, dst, kd, vd)
        if mesh is not None:
            pool, rep = kv_pool_sharding(mesh).spec, PartitionSpec()
            copy = jax.shard_map(copy, mesh=mesh, in_specs=(pool, pool, rep, rep), out_specs=(pool, pool),
                                 check_vma=False)
            scatter = jax.shard_map(scatter, mesh=mesh, in_specs=(pool, pool, rep, pool, pool),
                                    out_specs=(pool, pool), check_vma=False)
    else:
        copy = lambda kc, vc, src, dst: tuple(c.at[:, :, dst].set(c[:, :, src]) for c in (kc, vc))
        scatter = lambda kc, vc, dst, kd, vd: tuple(c.at[:, :, dst].set(d) for c, d in ((kc, kd), (vc, vd)))
    return (jax.jit(lambda kv, src, dst: copy(*kv, src, dst), donate_argnums=(0,)),
            jax.jit(lambda kv, dst, data: scatter(*kv, dst, *data), donate_argnums=(0,)))


class BlockMover:
    """Block copies on device (copy-on-write) and to/from host memory (swap), with bucketed sizes.

    Padding entries copy the sink block onto itself, so every call compiles for a power-of-two count.
    """

    def __init__(self, runner: "ModelRunner", block_size: int, swap_blocks: int):
        self.runner = runner
        self.block_size = block_size
        self.swap_blocks = swap_blocks  # capacity of the host swap space, in blocks
        self.swapped_blocks = 0
        self._copy_blocks, self._scatter_blocks = _block_writers(runner.kv_cache[0].dtype, runner.mesh)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        if self.runner.publish is not None:
            self.runner.publish(CopyBlocks(pairs))
        size = _blocks_bucket(len(pairs))
        src = np.zeros(size, np.int32)
        dst = np.zeros(size, np.int32)
        src[:len(pairs)], dst[:len(pairs)] = zip(*pairs)
        self.runner.kv_cache = self._copy_blocks(self.runner.kv_cache, src, dst)

    def swap_out(self, request) -> bool:
        """Copies the request's computed blocks to host memory, if the swap space has room."""
        num = -(-request.num_computed_tokens // self.block_size)
        if num == 0 or self.swapped_blocks + num > self.swap_blocks:
            return False
        ids = np.zeros(_blocks_bucket(num), np.int32)
        ids[:num] = request.block_ids[:num]
        k, v = _gather_blocks(self.runner.kv_cache, ids)
        request.swapped_kv = (np.asarray(k)[:, :, :num], np.asarray(v)[:, :, :num])
        self.swapped_blocks += num
        return True

    def swap_in(self, request) -> None:
        """Writes a swapped request's K/V into its freshly allocated blocks; frees the host copy."""
        k, v = request.swapped_kv
        num = k.shape[2]
        size = _blocks_bucket(num)
        ids = np.zeros(size, np.int32)
        ids[:num] = request.block_ids[:num]
        pad = [(0, 0), (0, 0), (0, size - num), (0, 0), (0, 0)]
        data = (np.pad(k, pad), np.pad(v, pad))
        # Padding rows write zeros into the sink block, which is never read unmasked.
        self.runner.kv_cache = self._scatter_blocks(self.runner.kv_cache, ids, data)
        request.swapped_kv = None
        self.swapped_blocks -= num

    def release(self, request) -> None:
        """Drops a swapped request's host copy (it finished or was aborted while swapped out)."""
        if request.swapped_kv is not None:
            self.swapped_blocks -= request.swapped_kv[0].shape[2]
            request.swapped_kv = None
