"""Token sampling on device, fused into the jitted step so only token ids return to the host.

Each row carries its own temperature, filters and seed; a row's random key is its seed folded with the
number of tokens it has generated, so its samples do not depend on what else shares the batch (or on
preemption, which recomputes but does not re-sample).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling inputs, padded to the step's sequence bucket S.

    Attributes:
      temperature: float32 [S]; 0 means greedy.
      top_k: int32 [S]; 0 disables.
      top_p: float32 [S]; 1 disables.
      min_p: float32 [S]; 0 disables.
      seeds: uint32 [S]; the request's seed.
      output_index: int32 [S]; how many tokens the request has generated (folded into its key).
      banned_ids: int32 [S, B]; token ids that must not be sampled (min_tokens), -1 = unused.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seeds: jax.Array
    output_index: jax.Array
    banned_ids: jax.Array


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array) -> jax.Array:
    """Temperature-scaled logits with filtered-out tokens at -inf. float32 [S, V] -> [S, V].

    Order: min_p on the full distribution, then top_k, then top_p on the renormalised remainder (a token
    stays while the probability mass ranked strictly above it is below top_p, so the top token always stays).
    """
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]

    def apply_filters(scaled):
        sorted_logits, order = jax.lax.top_k(scaled, vocab)  # descending
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        keep = probs >= min_p[:, None] * probs[:, :1]
        rank = jnp.arange(vocab)[None, :]
        keep &= rank < jnp.where(top_k > 0, top_k, vocab)[:, None]
        kept = jnp.where(keep, probs, 0.0)
        kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
        mass_above = jnp.cumsum(kept, axis=-1) - kept
        keep &= mass_above < top_p[:, None]
        filtered_sorted = jnp.where(keep, sorted_logits, -jnp.inf)
        rows = jnp.arange(scaled.shape[0])[:, None]
        return jnp.full_like(scaled, -jnp.inf).at[rows, order].set(filtered_sorted)

    # Sorting the vocabulary is the expensive part; skip it when no row filters.
    needs_filter = jnp.any(((top_k > 0) & (top_k < vocab)) | (top_p < 1.0) | (min_p > 0.0))
    return jax.lax.cond(needs_filter, apply_filters, lambda s: s, scaled)


def sample(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """Picks one token per row. logits float32 [S, V] -> int32 [S]."""
    rows = jnp.arange(logits.shape[0])[:, None]
    banned = jnp.where(meta.banned_ids >= 0, meta.banned_ids, logits.shape[-1])  # out of range -> dropped
    logits = logits.at[rows, banned].set(-jnp.inf, mode="drop")
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def random_tokens(logits):
        filtered = filter_logits(logits, meta.temperature, meta.top_k, meta.top_p, meta.min_p)
        keys = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.key(seed), i))(
            meta.seeds, meta.output_index)
        sampled = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, filtered)
        return jnp.where(meta.temperature > 0, sampled.astype(jnp.int32), greedy_tokens)

    return jax.lax.cond(jnp.any(meta.temperature > 0), random_tokens, lambda _: greedy_tokens, logits)
