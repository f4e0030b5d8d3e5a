"""Ragged paged attention as a portable Pallas kernel: prefill, chunked prefill and decode in one batch.

The step's query tokens arrive packed ([num_tokens, ...], sequence after sequence, offsets in
`query_start`). Their K/V are already written to the pool, so every query reads all its keys (the cached
prefix and its own chunk alike) from the pages, causally: one rule serves fresh prompts, continuing chunks,
prefix-cache hits and decode tokens.

Work is cut into query blocks of `tokens_per_block` tokens that never straddle two sequences: a sequence
with n new tokens gets ceil(n / tokens_per_block) blocks, so the grid has at most
num_tokens / tokens_per_block + num_seqs blocks (static), and blocks past the last real one are idle. One
program per (query block, KV head) holds the block's tokens times the GQA group as one tile of rows, so each
page is read once for all of them. The wrapper gathers the packed queries into this block layout and the
results back (cheap next to the K/V traffic), so the kernel's loads and stores are whole blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from paged.kernels.gpu.decode import GPU_MIN_ROWS
from paged.kernels.page_walk import (KEYS_PER_STEP, attend_pages, layer_window_scalars, query_block_layout,
                                     validate_ragged_inputs)


def _ragged_kernel(scalars_ref, block_seq_ref, block_first_pos_ref, block_num_tokens_ref, page_tables_ref, q_ref,
                   k_ref, v_ref, o_ref, *, scale, soft_cap, group, pages_per_step):
    """One (query block, KV head) program.

    scalars_ref: int32 [2] (layer, sliding window; <= 0 means none).
    block_seq_ref, block_first_pos_ref, block_num_tokens_ref: int32 [NB]; each block's sequence row, the
      position of its first token, and how many of its tokens are real (0: idle block).
    page_tables_ref: int32 [S, P + pages_per_step]. q_ref, o_ref: [rows, D], rows = tokens_per_block * group
      (token-major). k_ref, v_ref: the pool [L, Hkv, N, bs, D] (pl.ANY).
    """
    block, head = pl.program_id(0), pl.program_id(1)
    layer, window = scalars_ref[0], scalars_ref[1]
    seq = block_seq_ref[block]
    first_pos = block_first_pos_ref[block]
    num_tokens = block_num_tokens_ref[block]
    rows = q_ref.shape[0]
    page_size = k_ref.shape[3]

    row_token = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group
    row_pos = first_pos + row_token  # [rows, 1]
    row_real = row_token < num_tokens
    last_pos = first_pos + num_tokens - 1
    first_key = jnp.where(window > 0, jnp.maximum(first_pos - window + 1, 0), 0)
    start_page = first_key // page_size
    end_page = jnp.where(num_tokens > 0, pl.cdiv(last_pos + 1, page_size), start_page)

    def visible(key_pos):
        return (key_pos <= row_pos) & row_real & ((key_pos > row_pos - window) | (window <= 0))

    _, l, acc = attend_pages(q_ref[...].astype(jnp.float32) * scale,
                             lambda first, n: page_tables_ref[seq, pl.ds(first, n)], k_ref, v_ref, layer, head,
                             start_page, pl.cdiv(end_page - start_page, pages_per_step), visible,
                             soft_cap=soft_cap, pages_per_step=pages_per_step)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "tokens_per_block", "pages_per_step",
                                             "interpret"))
def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    query_start: jax.Array,
    seq_lens: jax.Array,
    layer: jax.Array | int = 0,
    sliding_window: jax.Array | int | None = None,
    *,
    scale: float,
    soft_cap: float | None = None,
    tokens_per_block: int | None = None,
    pages_per_step: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Causal attention of packed new tokens over their sequences' paged context.

    Args:
      q: [num_tokens, num_q_heads, head_dim]; sequence s owns tokens query_start[s]:query_start[s + 1], at
        positions seq_lens[s] - n_s .. seq_lens[s] - 1 (n_s its token count). Tokens from query_start[-1] on
        are padding: their output is zeros.
      k_pages, v_pages: [num_layers, num_kv_heads, num_pages, page_size, head_dim] (or without the layer
        axis); the pool, with this step's K/V already written.
      page_tables: int32 [num_seqs, pages_per_seq].
      query_start: int32 [num_seqs + 1]; non-decreasing packed offsets, query_start[0] = 0.
      seq_lens: int32 [num_seqs]; context length of each sequence including its new tokens (0: padded row).
      layer: int32 scalar; which layer of the pool to read.
      sliding_window: int or int32 scalar; a query at position p sees keys > p - sliding_window; None or
        <= 0: all.
      scale: softmax scale. soft_cap: optional logit soft cap.
      tokens_per_block: query tokens per program (default: about 64 rows with the GQA group, at least 16 on GPU).
      pages_per_step: pages per inner step (default: about 64 keys).
      interpret: run in Pallas interpret mode (default: on CPU).

    Returns:
      [num_tokens, num_q_heads, head_dim] in q's dtype.
    """
    if k_pages.ndim == 4:
        k_pages, v_pages = k_pages[None], v_pages[None]
    validate_ragged_inputs(q, k_pages, v_pages, page_tables, query_start, seq_lens)
    interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_pages.shape[1], k_pages.shape[3]
    group = num_q_heads // num_kv_heads
    padded_group = group if interpret else pl.next_power_of_2(group)
    if tokens_per_block is None:
        tokens_per_block = max(1, 64 // padded_group) if not interpret else max(1, min(16, 64 // group))
    if not interpret:
        tokens_per_block = max(tokens_per_block, pl.cdiv(GPU_MIN_ROWS, padded_group))
    rows = tokens_per_block * padded_group
    if pages_per_step is None:
        pages_per_step = max(1, KEYS_PER_STEP // page_size)
    page_tables = jnp.pad(page_tables, ((0, 0), (0, pages_per_step)))

    num_blocks, layout, (token_block, token_slot, token_real) = query_block_layout(
        query_start, seq_lens, num_tokens, tokens_per_block)
    # Packed tokens -> [NB, Hkv, tokens_per_block * padded_group, D] (slots with no token hold zeros).
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    if padded_group != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, padded_group - group), (0, 0)))
    blocks = jnp.zeros((num_blocks, tokens_per_block, num_kv_heads, padded_group, head_dim), q.dtype)
    blocks = blocks.at[jnp.where(token_real, token_block, num_blocks), token_slot].set(qg, mode="drop")
    blocks = blocks.transpose(0, 2, 1, 3, 4).reshape(num_blocks, num_kv_heads, rows, head_dim)

    scalars = layer_window_scalars(layer, sliding_window)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    block_spec = pl.BlockSpec((None, None, rows, head_dim), lambda b, h: (b, h, 0, 0))
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton
        compiler_params = pl_triton.CompilerParams(num_warps=4, num_stages=2)
    out = pl.pallas_call(
        functools.partial(_ragged_kernel, scale=scale, soft_cap=soft_cap, group=padded_group,
                          pages_per_step=pages_per_step),
        grid=(num_blocks, num_kv_heads),
        in_specs=[any_spec] * 5 + [block_spec, any_spec, any_spec],
        out_specs=block_spec,
        out_shape=jax.ShapeDtypeStruct(blocks.shape, q.dtype),
        interpret=interpret,
        compiler_params=compiler_params,
        name="ragged_paged_attention",
    )(scalars, *layout, page_tables, blocks, k_pages, v_pages)

    out = out.reshape(num_blocks, num_kv_heads, tokens_per_block, padded_group, head_dim)
    out = out[token_block, :, token_slot, :group]  # [T, Hkv, group, D]
    out = jnp.where(token_real[:, None, None, None], out, 0)
    return out.reshape(num_tokens, num_q_heads, head_dim)
