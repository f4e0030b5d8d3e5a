"""Paged attention kernels and their plain `jax.numpy` references, arranged by where they run.

This package imports nothing from the rest of the project: kernels are usable on their own.

- `gpu/`: portable Pallas kernels, `paged_decode_attention` and `ragged_paged_attention` (Triton lowering on
  NVIDIA GPUs, interpret mode on CPU), and the Hopper decode kernel (`gpu/decode_mgpu.py`, Mosaic GPU).
- `tpu/`: `tpu.ragged.ragged_paged_attention_tpu`, the ragged kernel for TPUs (Mosaic TPU; the TPU
  interpreter on CPU), and `tpu.block_sizes`, its tiling rules and per-generation block sizes.
- `cpu/`: the native CPU kernels (C++ through XLA's FFI, built on first use): `cpu.paged_attention_cpu`, the
  fastest paged read on CPU, and `cpu.matmul_cpu`; `cpu.available()` says whether they built here.
- `xla.py`: `paged_attention_chunked`, `packed_causal_attention`, the XLA path (prompt chunks; the fallback).
- `reference.py`: `paged_attention_reference` and the per-kernel references; `write_kv_to_cache`.
- `page_walk.py`: the page walk and online softmax the Pallas kernels share.
- `platform.py`: `select_backends`, which kernels "auto" means on each platform.
- `cache.py`: `cache_root()`, where builds and caches are kept (`$PAGED_CACHE_DIR`).
"""

from paged.kernels.gpu.decode import paged_decode_attention
from paged.kernels.gpu.ragged import ragged_paged_attention
from paged.kernels.platform import select_backends
from paged.kernels.reference import (
                                     paged_attention_reference,
                                     paged_decode_reference,
                                     ragged_paged_attention_reference,
                                     to_pool_dtype,
                                     write_kv_to_cache,
                                     )
from paged.kernels.xla import packed_causal_attention, paged_attention_chunked

__all__ = ["packed_causal_attention", "paged_attention_chunked", "paged_attention_reference",
           "paged_decode_attention", "paged_decode_reference", "ragged_paged_attention",
           "ragged_paged_attention_reference", "select_backends", "to_pool_dtype", "write_kv_to_cache"]
