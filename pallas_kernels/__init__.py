"""Paged attention kernels and their plain `jax.numpy` references.

This package imports nothing from the rest of the project: kernels are usable on their own.
"""

from pallas_kernels.reference import (
    paged_attention_reference,
    write_kv_to_cache,
)
from pallas_kernels.xla import packed_causal_attention, paged_attention_chunked

__all__ = ["packed_causal_attention", "paged_attention_chunked", "paged_attention_reference", "write_kv_to_cache"]
