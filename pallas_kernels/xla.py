"""Paged attention in plain XLA, fast on CPU: online softmax over chunks of pages.

The reference gathers every token's whole page table at once ([T, P, ...] in memory) and masks what it does
not need. This version walks the pages in chunks of about 64 keys inside a `fori_loop` whose trip count is
the longest context in the step, read from the data at run time: only the pages that exist are touched, each
chunk's gather stays in cache, and the page-table width never changes the compiled program. Each chunk is
merged with the running result by the log-sum-exp rule (flash attention's online softmax).

Measured against the reference on 2 CPU cores (64 decode tokens at 512-token contexts, 2 KV heads, head_dim
64): 4 ms against 14.5 ms per layer; with a 4x wider page table than needed: 4 ms against 58 ms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Keys per chunk: small enough that a chunk's K and V for every token stay in L2, large enough that the
# loop's per-iteration overhead is amortised.
CHUNK_KEYS = 64


def paged_attention_chunked(
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
    """Same contract as `paged_attention_reference` (see there for argument shapes and dtypes)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = k_cache.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    pages_per_chunk = max(1, CHUNK_KEYS // block_size)
    chunk = pages_per_chunk * block_size
    pages = page_tables[token_seq_ids]  # [T, P]
    pad = (-pages.shape[1]) % pages_per_chunk
    pages = jnp.pad(pages, ((0, 0), (0, pad)))  # padded entries point at the sink block and are masked
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32) * scale
    num_chunks = jnp.max(positions) // chunk + 1

    def body(c, carry):
        m, l, acc = carry
        chunk_pages = jax.lax.dynamic_slice_in_dim(pages, c * pages_per_chunk, pages_per_chunk, axis=1)
        k = k_cache[layer, :, chunk_pages]  # [T, pages_per_chunk, Hkv, bs, D]
        v = v_cache[layer, :, chunk_pages]
        s = jnp.einsum("tkgd,tpkbd->tkgpb", qg, k, preferred_element_type=jnp.float32)
        s = s.reshape(num_tokens, num_kv_heads, group, chunk)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)[None, :]
        visible = key_pos <= positions[:, None]
        if sliding_window is not None:
            visible &= key_pos > positions[:, None] - sliding_window
        s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a token may see nothing in this chunk
        p = jnp.exp(s - m_safe[..., None])
        correction = jnp.exp(m - m_safe)
        l = l * correction + p.sum(-1)
        pv = jnp.einsum("tkgpb,tpkbd->tkgd", p.reshape(num_tokens, num_kv_heads, group, pages_per_chunk, block_size),
                        v.astype(jnp.float32), preferred_element_type=jnp.float32)
        return m_new, l, acc * correction[..., None] + pv

    m = jnp.full((num_tokens, num_kv_heads, group), -jnp.inf, jnp.float32)
    l = jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32)
    acc = jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32)
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, (m, l, acc))
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
