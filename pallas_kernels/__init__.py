"""Paged attention kernels and their plain `jax.numpy` references.

This package imports nothing from the rest of the project: kernels are usable on their own.

- `paged_decode_attention`, `ragged_paged_attention`: portable Pallas kernels (Triton lowering on NVIDIA
  GPUs, interpret mode on CPU); `paged_decode_reference`, `ragged_paged_attention_reference` beside them.
- `cpu_kernel.paged_attention_cpu`: a native CPU kernel (C++ through XLA's FFI, built on first use), the
  fastest paged read on CPU; `cpu_kernel.available()` says whether it built here.
- `paged_attention_chunked`, `packed_causal_attention`: the XLA path (prompt chunks on CPU; the fallback).
- `paged_attention_reference`, `write_kv_to_cache`: the token-level reference and the pool write.
"""

from pallas_kernels.decode import paged_decode_attention
from pallas_kernels.ragged import ragged_paged_attention
from pallas_kernels.reference import (
    paged_attention_reference,
    paged_decode_reference,
    ragged_paged_attention_reference,
    write_kv_to_cache,
)
from pallas_kernels.xla import packed_causal_attention, paged_attention_chunked

__all__ = ["packed_causal_attention", "paged_attention_chunked", "paged_attention_reference",
           "paged_decode_attention", "paged_decode_reference", "ragged_paged_attention",
           "ragged_paged_attention_reference", "write_kv_to_cache"]
