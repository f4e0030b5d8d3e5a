"""Owns the device side: parameters, the KV pool, and the jitted step."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from paged.batch import StepInputs
from paged.sampler import sample


def kv_block_bytes(model_config, block_size: int, dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    c = model_config
    return 2 * c.num_layers * c.num_kv_heads * block_size * c.head_dim * np.dtype(dtype).itemsize


def kv_budget_bytes(memory_utilization: float) -> int:
    """Bytes available for the KV pool on the default device, after what is already allocated (weights).

    GPUs report their limit through memory_stats; on CPU the pool lives in host memory, so the budget is a
    fraction of what the OS reports as available.
    """
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"] * memory_utilization) - int(stats.get("bytes_in_use", 0))
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(available * memory_utilization)


class ModelRunner:
    def __init__(self, model, params, attention, num_blocks: int, block_size: int, dtype):
        cfg = model.config
        self.model = model
        self.params = params
        self.attention = attention
        shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
        self.kv_cache = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        self.num_compilations = 0
        # The pool is donated: XLA writes the new K/V into the same buffers instead of copying the pool.
        self._step = jax.jit(self._step_impl, donate_argnums=(1,))

    def _step_impl(self, params, kv_cache, inputs: StepInputs):
        self.num_compilations += 1  # runs only while tracing, i.e. once per new input shape
        logits, kv_cache = self.model.forward(params, kv_cache, inputs.token_ids, inputs.attention,
                                              inputs.logits_indices, self.attention)
        return kv_cache, sample(logits, inputs.sampling)

    def run(self, inputs: StepInputs) -> np.ndarray:
        """Runs one step; returns the sampled token ids int32 [S] on the host."""
        self.kv_cache, tokens = self._step(self.params, self.kv_cache, inputs)
        return np.asarray(tokens)
