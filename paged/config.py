"""Engine configuration: one frozen dataclass, validated up front."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes that fix the engine's memory and compiled shapes.

    Defaults suit a CPU: 64 sequences and 512 tokens per step keep every compiled shape small while still
    batching decode widely; GPUs want larger values (vLLM uses 256 and 8192).
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space: float = 4.0  # GiB of host memory for swapped-out K/V (preemption_mode="swap")
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    # How the decoder layers run: "scan" compiles one layer and loops over stacked weights; "unroll" compiles
    # every layer with its own weights. "auto" unrolls on CPU, where XLA copies each scanned layer's weights
    # out of the stacked arrays on every step (unrolled decode steps are 10-30% faster there, compiles slower).
    layer_loop: str = "auto"
    # Schedule and launch step t+1 while step t still runs, its rows reading t's samples on the device: the
    # host's scheduling, input preparation and output handling overlap device work (on the 2-core CPU
    # benchmark +5% output tokens/s; more where the device is not the host's own cores). step() returns each
    # step's outputs one call later. Same tokens either way.
    async_scheduling: bool = True
    # Where compiled steps are kept between runs (paged/compilation_cache.py): "auto" = JAX's own setting if
    # the user made one, else $PAGED_CACHE_DIR/xla (~/.cache/paged/xla); a path; or None to leave JAX alone.
    compilation_cache_dir: str | None = "auto"
    seed: int = 0

    def validate(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(isinstance(self.block_size, int) and self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
              f"block_size must be a power of two from 1 to 128, got {self.block_size!r}")
        check(self.num_kv_blocks is None or (isinstance(self.num_kv_blocks, int) and self.num_kv_blocks >= 2),
              f"num_kv_blocks must be None or an integer >= 2, got {self.num_kv_blocks!r}")
        check(0 < self.gpu_memory_utilization <= 1,
              f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        check(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1,
              f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        check(self.max_num_batched_tokens is None
              or (isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1),
              f"max_num_batched_tokens must be None or an integer >= 1, got {self.max_num_batched_tokens!r}")
        check(self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 1),
              f"max_model_len must be None or an integer >= 1, got {self.max_model_len!r}")
        check(self.preemption_mode in ("recompute", "swap"),
              f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        check(self.layer_loop in ("auto", "scan", "unroll"),
              f"layer_loop must be 'auto', 'scan' or 'unroll', got {self.layer_loop!r}")
        check(isinstance(self.async_scheduling, bool),
              f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        check(self.compilation_cache_dir is None or (isinstance(self.compilation_cache_dir, str)
                                                      and self.compilation_cache_dir.strip() != ""),
              f"compilation_cache_dir must be 'auto', a directory or None, got {self.compilation_cache_dir!r}")
        check(isinstance(self.swap_space, (int, float)) and self.swap_space >= 0,
              f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")

    def resolved(self, model_max_len: int) -> "EngineConfig":
        """Fills max_model_len and max_num_batched_tokens from the model and each other."""
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                             f"({model_max_len})")
        tokens = self.max_num_batched_tokens
        if tokens is None:
            tokens = 512 if self.enable_chunked_prefill else max(512, max_model_len)
        if not self.enable_chunked_prefill and tokens < max_model_len:
            raise ValueError(f"max_num_batched_tokens={tokens} is smaller than max_model_len={max_model_len}; "
                             "without chunked prefill a long prompt could never be scheduled. Raise it, lower "
                             "max_model_len, or set enable_chunked_prefill=True")
        return dataclasses.replace(self, max_model_len=max_model_len, max_num_batched_tokens=tokens)
