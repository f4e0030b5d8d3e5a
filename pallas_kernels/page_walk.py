"""The page walk and online softmax the GPU kernels share (the portable decode and ragged kernels, the Mosaic
GPU decode kernel), and the query-block layout and argument checks of the ragged kernels (GPU and TPU).

A program attends a tile of queries over a run of one sequence's pages, read from the pool in place
(`memory_space=pl.ANY`, indexed by page-table values inside the kernel), keeping the running max `m`, sum `l`
and unnormalised output `acc` in float32; split programs' partial results merge by the log-sum-exp rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite stand-in for -inf on masked logits: exp(MASK - m) underflows to 0 without inf - inf = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Keys per inner step: enough to amortise the loop and fill a tensor-core tile, small enough for registers.
KEYS_PER_STEP = 64


def layer_window_scalars(layer, sliding_window) -> jax.Array:
    """int32 [2] (layer, window; 0 = no window): the per-call scalars every kernel reads first."""
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
    return jnp.stack([jnp.asarray(layer, jnp.int32), window])


def decode_page_range(length, window, split, pages_per_split, page_size, pages_per_step):
    """The pages one decode program walks: (first visible key, start page, end page, inner steps).

    The query sits at position length - 1 and sees keys from length - window on (all with window <= 0);
    split `split` owns pages [split * pages_per_split, (split + 1) * pages_per_split).
    """
    first_key = jnp.where(window > 0, jnp.maximum(length - window, 0), 0)
    split_start = split * pages_per_split
    start_page = jnp.maximum(split_start, first_key // page_size)
    end_page = jnp.minimum(split_start + pages_per_split, (length + page_size - 1) // page_size)
    num_steps = jnp.maximum((end_page - start_page + pages_per_step - 1) // pages_per_step, 0)
    return first_key, start_page, end_page, num_steps


def attend_pages(q, page_row, k_ref, v_ref, layer, head, start_page, num_steps, visible_fn, *, soft_cap,
                 pages_per_step):
    """Online softmax of a tile of queries over a run of one sequence's pages (shared by the kernels).

    q: float32 [rows, D], already scaled. page_row(first, n): int32 [n] page ids from the page table.
    k_ref, v_ref: the pool [L, Hkv, N, bs, D] (pl.ANY). visible_fn(key_pos [rows, keys]) -> bool mask.
    Walks `num_steps` steps of `pages_per_step` pages from `start_page`. Masked logits get a finite
    MASK_VALUE and masked probabilities are forced to 0, so rows that see nothing end with l = 0, acc = 0.
    Returns (m, l, acc): float32 [rows, 1], [rows, 1], [rows, D], acc unnormalised.
    """
    rows, head_dim = q.shape
    page_size = k_ref.shape[3]
    keys_per_step = pages_per_step * page_size

    def body(step, carry):
        m, l, acc = carry
        page0 = start_page + step * pages_per_step
        pages = page_row(page0, pages_per_step)
        k = k_ref[layer, head, pages].reshape(keys_per_step, head_dim).astype(jnp.float32)
        v = v_ref[layer, head, pages].reshape(keys_per_step, head_dim).astype(jnp.float32)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        visible = visible_fn(page0 * page_size + jax.lax.broadcasted_iota(jnp.int32, (rows, keys_per_step), 1))
        s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
        p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=1, keepdims=True)
        acc = acc * correction + jnp.dot(p, v, preferred_element_type=jnp.float32)
        return m_new, l, acc

    m = jnp.full((rows, 1), MASK_VALUE, jnp.float32)
    l = jnp.zeros((rows, 1), jnp.float32)
    acc = jnp.zeros((rows, head_dim), jnp.float32)
    return jax.lax.fori_loop(0, num_steps, body, (m, l, acc))


def query_block_layout(query_start, seq_lens, num_tokens, tokens_per_block):
    """How the ragged kernels cut a step's packed tokens into query blocks that never straddle two sequences.

    A sequence with n new tokens gets ceil(n / tokens_per_block) blocks, so num_blocks = num_tokens //
    tokens_per_block + num_seqs (static) bounds any split; blocks past the last real one are idle.
    Returns (num_blocks, (block_seq, block_first_pos, block_num_tokens), (token_block, token_slot,
    token_real)): per block, int32 [num_blocks] its sequence row, the position of its first token and how
    many of its tokens are real (0: idle); per packed token, int32 [num_tokens] its block and slot, and
    bool [num_tokens] whether it is real (not padding).
    """
    num_seqs = seq_lens.shape[0]
    num_blocks = num_tokens // tokens_per_block + num_seqs  # >= sum(ceil(n_s / tpb)) for any split of tokens
    q_lens = query_start[1:] - query_start[:-1]
    blocks_per_seq = (q_lens + tokens_per_block - 1) // tokens_per_block
    block_end = jnp.cumsum(blocks_per_seq)
    block_begin = block_end - blocks_per_seq
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    block_seq = jnp.minimum(jnp.searchsorted(block_end, b, side="right"), num_seqs - 1).astype(jnp.int32)
    local = b - block_begin[block_seq]
    real = b < block_end[-1]
    block_first_pos = seq_lens[block_seq] - q_lens[block_seq] + local * tokens_per_block
    block_num_tokens = jnp.where(real, jnp.clip(q_lens[block_seq] - local * tokens_per_block, 0, tokens_per_block), 0)

    t = jnp.arange(num_tokens, dtype=jnp.int32)
    token_seq = jnp.clip(jnp.searchsorted(query_start, t, side="right") - 1, 0, num_seqs - 1)
    offset = t - query_start[token_seq]
    token_block = block_begin[token_seq] + offset // tokens_per_block
    token_slot = offset % tokens_per_block
    token_real = t < query_start[-1]
    layout = (block_seq, block_first_pos.astype(jnp.int32), block_num_tokens.astype(jnp.int32))
    return num_blocks, layout, (token_block, token_slot, token_real)


def validate_ragged_inputs(q, k_pages, v_pages, page_tables, query_start, seq_lens):
    """The ragged kernels' argument checks (GPU and TPU), with messages that say what was got."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim]; got shape {q.shape}")
    if k_pages.ndim != 5 or k_pages.shape != v_pages.shape:
        raise ValueError("k_pages and v_pages must share a shape [num_layers, num_kv_heads, num_pages, page_size, "
                         f"head_dim] (layer axis optional); got {k_pages.shape} and {v_pages.shape}")
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = k_pages.shape[1]
    if k_pages.shape[-1] != head_dim:
        raise ValueError(f"q head_dim {head_dim} != pool head_dim {k_pages.shape[-1]}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    num_seqs = page_tables.shape[0]
    if page_tables.ndim != 2 or page_tables.dtype != jnp.int32:
        raise ValueError(f"page_tables must be int32 [num_seqs, pages_per_seq]; got {page_tables.dtype} "
                         f"{page_tables.shape}")
    if query_start.shape != (num_seqs + 1,) or query_start.dtype != jnp.int32:
        raise ValueError(f"query_start must be int32 [num_seqs + 1 = {num_seqs + 1}]; got {query_start.dtype} "
                         f"{query_start.shape}")
    if seq_lens.shape != (num_seqs,) or seq_lens.dtype != jnp.int32:
        raise ValueError(f"seq_lens must be int32 [num_seqs = {num_seqs}]; got {seq_lens.dtype} {seq_lens.shape}")


def merge_splits(out: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Combines per-split partial results [splits, ...] into a normalised [1, ...] result (log-sum-exp)."""
    m_all = m.max(axis=0, keepdims=True)
    weight = jnp.exp(m - m_all)  # splits that saw no key have l = 0 and add nothing
    l_all = (l * weight).sum(axis=0, keepdims=True)
    acc = (out * weight).sum(axis=0, keepdims=True)
    return acc / jnp.where(l_all > 0, l_all, 1.0)
