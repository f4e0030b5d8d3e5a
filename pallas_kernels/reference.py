"""Reference paged attention in plain `jax.numpy`.

KV pool layout (one array for K, one for V, all layers stacked):

    [num_layers, num_kv_heads, num_blocks, block_size, head_dim]

A page of one KV head is one contiguous `block_size x head_dim` tile, so a GPU kernel that walks one KV
head at a time copies each page with a single bulk transfer, and every query head of a GQA group reuses it.
Functions take the whole stacked pool plus a layer index: slicing a layer out first would copy it.

Block 0 is reserved by the engine as a sink: padded tokens write there and padded page-table entries point
there; the reads are always masked out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv_to_cache(
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatters new keys and values into their slots of the pool.

    Args:
      k_cache, v_cache: [num_layers, num_kv_heads, num_blocks, block_size, head_dim].
      layer: int32 scalar; the layer to write.
      k, v: [num_tokens, num_kv_heads, head_dim]; cast to the pool's dtype (`to_pool_dtype`).
      slot_mapping: int32 [num_tokens]; slot = block * block_size + offset. Padded tokens point at a slot
        of the sink block.

    Returns:
      The updated (k_cache, v_cache).
    """
    block_size = k_cache.shape[3]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    # Advanced indices separated by a slice put the token axis first: the update is [T, Hkv, D].
    k_cache = k_cache.at[layer, :, blocks, offsets].set(to_pool_dtype(k, k_cache.dtype))
    v_cache = v_cache.at[layer, :, blocks, offsets].set(to_pool_dtype(v, v_cache.dtype))
    return k_cache, v_cache


def to_pool_dtype(x: jax.Array, dtype) -> jax.Array:
    """x in a pool's dtype. float8 pools (kv_cache_dtype="fp8") saturate at the format's largest finite value
    (448 for e4m3): e4m3fn has no infinity, and a cast would turn an outlier into NaN."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 1 and x.dtype != dtype:
        limit = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -limit, limit)
    return x.astype(dtype)


def paged_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    page_tables: jax.Array,
    token_seq_ids: jax.Array,
    positions: jax.Array,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Ragged paged attention for a packed batch of query tokens (prefill, decode or both).

    Each query token attends causally to the cached keys of its own sequence at positions 0..position
    (inclusive). The new tokens' K/V must already be written to the pool, so one rule serves prefill,
    chunked prefill, prefix-cache hits and decode.

    Args:
      q: [num_tokens, num_q_heads, head_dim].
      k_cache, v_cache: [num_layers, num_kv_heads, num_blocks, block_size, head_dim].
      layer: int32 scalar; the layer to read.
      page_tables: int32 [num_seqs, pages_per_seq]; row s lists the blocks of sequence s in order.
      token_seq_ids: int32 [num_tokens]; the row of `page_tables` each token belongs to.
      positions: int32 [num_tokens]; each token's position in its sequence.
      scale: softmax scale, usually head_dim ** -0.5.
      sliding_window: if set (an int or an int32 scalar, which may be traced), a token at position p sees
        keys at positions > p - sliding_window; a value <= 0 means no window (so one compiled layer body can
        serve models that alternate sliding and global layers).
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap).

    Returns:
      [num_tokens, num_q_heads, head_dim] in q's dtype.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = k_cache.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    pages = page_tables[token_seq_ids]  # [T, P]
    num_pages = pages.shape[1]
    context = num_pages * block_size

    # Advanced indices around a slice put [T, P] first: [T, P, Hkv, bs, D].
    k = k_cache[layer, :, pages]
    v = v_cache[layer, :, pages]
    if k.dtype.itemsize == 1:  # a float8 pool: dequantized on read, the math in q's dtype as for other pools
        k, v = k.astype(q.dtype), v.astype(q.dtype)

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    # Scores in float32 whatever the storage dtype: bf16 logits lose too much for long contexts.
    logits = jnp.einsum("tkgd,tpkbd->tkgpb", qg, k, preferred_element_type=jnp.float32) * scale
    logits = logits.reshape(num_tokens, num_kv_heads, group, context)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)

    key_pos = jnp.arange(context, dtype=jnp.int32)[None, :]
    visible = key_pos <= positions[:, None]
    if sliding_window is not None:
        visible &= (key_pos > positions[:, None] - sliding_window) | (sliding_window <= 0)
    logits = jnp.where(visible[:, None, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).reshape(num_tokens, num_kv_heads, group, num_pages, block_size)
    out = jnp.einsum("tkgpb,tpkbd->tkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def paged_decode_reference(q, k_pages, v_pages, page_tables, lengths, layer=0, sliding_window=None, *, scale,
                           soft_cap=None):
    """`jax.numpy` twin of `paged_decode_attention` (same arguments): one query per sequence at
    position lengths - 1; rows of length 0 give zeros."""
    if k_pages.ndim == 4:
        k_pages, v_pages = k_pages[None], v_pages[None]
    rows = jnp.arange(q.shape[0], dtype=jnp.int32)
    out = paged_attention_reference(q, k_pages, v_pages, layer, page_tables, rows, jnp.maximum(lengths - 1, 0),
                                    scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    return jnp.where((lengths > 0)[:, None, None], out, 0).astype(q.dtype)


def ragged_paged_attention_reference(q, k_pages, v_pages, page_tables, query_start, seq_lens, layer=0,
                                     sliding_window=None, *, scale, soft_cap=None):
    """`jax.numpy` twin of `ragged_paged_attention` (same arguments): each packed token's sequence and
    position come from the offsets; padding tokens give zeros."""
    if k_pages.ndim == 4:
        k_pages, v_pages = k_pages[None], v_pages[None]
    num_seqs = seq_lens.shape[0]
    t = jnp.arange(q.shape[0], dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(query_start, t, side="right") - 1, 0, num_seqs - 1).astype(jnp.int32)
    q_lens = query_start[1:] - query_start[:-1]
    positions = seq_lens[seq] - q_lens[seq] + (t - query_start[seq])
    out = paged_attention_reference(q, k_pages, v_pages, layer, page_tables, seq, jnp.maximum(positions, 0),
                                    scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    return jnp.where((t < query_start[-1])[:, None, None], out, 0).astype(q.dtype)
