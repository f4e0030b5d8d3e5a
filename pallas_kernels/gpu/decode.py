"""Decode paged attention as a portable Pallas kernel: one new query token per sequence.

One program per (sequence, KV head, KV split). It holds the whole GQA group of query heads of its KV head as
one tile, so each page of K and V is read once and serves every query head of the group. Pages are read
from the pool in place: the pool is passed with `memory_space=pl.ANY` and indexed by page-table values
inside the kernel (a BlockSpec over the pool would copy all of it per grid step in interpret mode).

The same `pallas_call` runs compiled on NVIDIA GPUs (Triton lowering, chosen explicitly through its
compiler params) and, unchanged, in interpret mode on CPU.

Split-KV (flash-decoding): with few sequences the grid alone cannot fill a GPU, so the pages of each
sequence are divided among `num_splits` programs whose partial results (running max, sum, unnormalised
output) are merged afterwards by the log-sum-exp rule.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from paged.kernels.page_walk import (KEYS_PER_STEP, attend_pages, decode_page_range, layer_window_scalars,
                                     merge_splits)

# Triton's dot needs at least 16 rows: small GQA groups are padded to this many query rows on GPU.
GPU_MIN_ROWS = 16


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


def default_num_splits(num_seqs: int, num_kv_heads: int, pages_per_seq: int, pages_per_step: int) -> int:
    """Splits per (sequence, KV head) so the grid covers the GPU about twice (1 on CPU).

    Each split keeps at least two inner steps of pages, so its partial result is worth the merge.
    """
    cores = getattr(jax.devices()[0], "core_count", None)
    if _on_cpu() or not cores:
        return 1
    wanted = pl.cdiv(2 * cores, num_seqs * num_kv_heads)
    return max(1, min(wanted, pages_per_seq // (2 * pages_per_step)))


def validate_decode_inputs(q, k_pages, v_pages, page_tables, lengths):
    if q.ndim != 3:
        raise ValueError(f"q must be [num_seqs, num_q_heads, head_dim]; got shape {q.shape}")
    if k_pages.ndim not in (4, 5) or k_pages.shape != v_pages.shape:
        raise ValueError("k_pages and v_pages must share a shape [num_layers, num_kv_heads, num_pages, page_size, "
                         f"head_dim] (layer axis optional); got {k_pages.shape} and {v_pages.shape}")
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, page_dim = k_pages.shape[-4], k_pages.shape[-1]
    if page_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != pool head_dim {page_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if page_tables.ndim != 2 or page_tables.shape[0] != num_seqs or page_tables.dtype != jnp.int32:
        raise ValueError(f"page_tables must be int32 [num_seqs={num_seqs}, pages_per_seq]; got "
                         f"{page_tables.dtype} {page_tables.shape}")
    if lengths.shape != (num_seqs,) or lengths.dtype != jnp.int32:
        raise ValueError(f"lengths must be int32 [num_seqs={num_seqs}]; got {lengths.dtype} {lengths.shape}")


def _decode_kernel(scalars_ref, lengths_ref, page_tables_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *,
                   scale, soft_cap, pages_per_step, pages_per_split, normalise):
    """One (sequence, KV head, split) program.

    scalars_ref: int32 [2] (layer, sliding window; <= 0 means none). lengths_ref: int32 [S].
    page_tables_ref: int32 [S, P + pages_per_step] (padded so a step never reads past the row).
    q_ref: [rows, D] (the group's query heads, padded). k_ref, v_ref: the pool [L, Hkv, N, bs, D] (pl.ANY).
    o_ref: [rows, D]; m_ref, l_ref: float32 [rows, 1], the split's running max and sum.
    """
    seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, window = scalars_ref[0], scalars_ref[1]
    length = lengths_ref[seq]
    page_size = k_ref.shape[3]

    first_key, start_page, end_page, num_steps = decode_page_range(length, window, split, pages_per_split,
                                                                    page_size, pages_per_step)
    # Keys past the split's last page belong to the next split (or do not exist).
    visible = lambda key_pos: (key_pos < length) & (key_pos >= first_key) & (key_pos < end_page * page_size)
    m, l, acc = attend_pages(q_ref[...].astype(jnp.float32) * scale,
                             lambda first, n: page_tables_ref[seq, pl.ds(first, n)], k_ref, v_ref, layer, head,
                             start_page, num_steps, visible, soft_cap=soft_cap, pages_per_step=pages_per_step)
    if normalise:  # one split: finish here; empty rows (length 0) give zeros
        acc = acc / jnp.where(l > 0, l, 1.0)
    o_ref[...] = acc.astype(o_ref.dtype)
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "pages_per_step", "num_splits", "interpret"))
def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    lengths: jax.Array,
    layer: jax.Array | int = 0,
    sliding_window: jax.Array | int | None = None,
    *,
    scale: float,
    soft_cap: float | None = None,
    pages_per_step: int | None = None,
    num_splits: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Attention of one new query token per sequence over its paged context.

    Args:
      q: [num_seqs, num_q_heads, head_dim]; the query at position `lengths - 1` of each sequence.
      k_pages, v_pages: [num_layers, num_kv_heads, num_pages, page_size, head_dim] (or without the layer
        axis); the engine's pool, read in place.
      page_tables: int32 [num_seqs, pages_per_seq]; row s lists the pages of sequence s in order. Entries
        past a sequence's length are never read as keys (any valid page id).
      lengths: int32 [num_seqs]; context length of each sequence including the new token. 0 marks a padded
        row: its output is zeros.
      layer: int32 scalar; which layer of the pool to read.
      sliding_window: int or int32 scalar; the query sees the last `sliding_window` keys; None or <= 0: all.
      scale: softmax scale, usually head_dim ** -0.5.
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap).
      pages_per_step: pages per inner step (default: about 64 keys).
      num_splits: programs per (sequence, KV head) sharing its pages (flash-decoding), merged by log-sum-exp
        (default: enough to cover a GPU's cores about twice; 1 on CPU).
      interpret: run in Pallas interpret mode (default: on CPU).

    Returns:
      [num_seqs, num_q_heads, head_dim] in q's dtype.
    """
    if k_pages.ndim == 4:
        k_pages, v_pages = k_pages[None], v_pages[None]
    validate_decode_inputs(q, k_pages, v_pages, page_tables, lengths)
    interpret = _on_cpu() if interpret is None else interpret
    num_seqs, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    rows = group if interpret else max(GPU_MIN_ROWS, pl.next_power_of_2(group))
    if pages_per_step is None:
        pages_per_step = max(1, KEYS_PER_STEP // page_size)
    pages_per_seq = page_tables.shape[1]
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, pages_per_seq, pages_per_step)
    pages_per_split = pl.cdiv(pl.cdiv(pages_per_seq, num_splits), pages_per_step) * pages_per_step
    # Room for the last step of the last split to read a whole step of (masked) page ids.
    page_tables = jnp.pad(page_tables, ((0, 0), (0, num_splits * pages_per_split + pages_per_step - pages_per_seq)))

    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    if rows != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    scalars = layer_window_scalars(layer, sliding_window)

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_decode_kernel, scale=scale, soft_cap=soft_cap, pages_per_step=pages_per_step,
                               pages_per_split=pages_per_split, normalise=num_splits == 1)
    out_shapes = [jax.ShapeDtypeStruct((num_splits, num_seqs, num_kv_heads, rows, head_dim),
                                       q.dtype if num_splits == 1 else jnp.float32),
                  jax.ShapeDtypeStruct((num_splits, num_seqs, num_kv_heads, rows, 1), jnp.float32),
                  jax.ShapeDtypeStruct((num_splits, num_seqs, num_kv_heads, rows, 1), jnp.float32)]
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton
        compiler_params = pl_triton.CompilerParams(num_warps=4, num_stages=2)
    out, m, l = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, num_splits),
        in_specs=[any_spec, any_spec, any_spec,
                  pl.BlockSpec((None, None, rows, head_dim), lambda s, h, c: (s, h, 0, 0)),
                  any_spec, any_spec],
        out_specs=[pl.BlockSpec((None, None, None, rows, head_dim), lambda s, h, c: (c, s, h, 0, 0)),
                   pl.BlockSpec((None, None, None, rows, 1), lambda s, h, c: (c, s, h, 0, 0)),
                   pl.BlockSpec((None, None, None, rows, 1), lambda s, h, c: (c, s, h, 0, 0))],
        out_shape=out_shapes,
        interpret=interpret,
        compiler_params=compiler_params,
        name="paged_decode_attention",
    )(scalars, lengths, page_tables, qg, k_pages, v_pages)
    if num_splits > 1:
        out = merge_splits(out, m, l)
    return out[0, :, :, :group].reshape(q.shape).astype(q.dtype)
