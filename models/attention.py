"""The attention-backend interface between the models and the kernels.

A backend writes the step's new K/V into the paged pool and computes attention for the packed query
tokens. Both calls take the whole stacked pool [L, Hkv, num_blocks, block_size, D] and a layer index. Backends are stateless objects selected by name; the model calls them inside the jitted step.
"""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels import paged_attention_chunked, paged_attention_reference, write_kv_to_cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs; every array is padded to the step's bucket sizes.

    Attributes:
      slot_mapping: int32 [T]; where each new token's K/V is written (block * block_size + offset).
      positions: int32 [T]; each token's position in its sequence.
      token_seq_ids: int32 [T]; the row of `page_tables` each token belongs to.
      page_tables: int32 [S, P]; block ids of each scheduled sequence (0 = sink block).
      query_start: int32 [S + 1]; packed offsets of each sequence's new tokens.
      seq_lens: int32 [S]; context length of each sequence after this step (0 for padded rows).
    """

    slot_mapping: jax.Array
    positions: jax.Array
    token_seq_ids: jax.Array
    page_tables: jax.Array
    query_start: jax.Array
    seq_lens: jax.Array


class ReferenceAttention:
    """`jax.numpy` paged attention: gathers each token's pages and masks by position."""

    name = "reference"

    def write_kv(self, k_cache, v_cache, layer, k, v, meta: AttentionMetadata):
        return write_kv_to_cache(k_cache, v_cache, layer, k, v, meta.slot_mapping)

    def attend(self, q, k_cache, v_cache, layer, meta: AttentionMetadata, *, scale, sliding_window=None):
        return paged_attention_reference(
            q, k_cache, v_cache, layer, meta.page_tables, meta.token_seq_ids, meta.positions,
            scale=scale, sliding_window=sliding_window)


class XlaAttention(ReferenceAttention):
    """XLA paged attention with an online softmax over chunks of pages: the fast path on CPU."""

    name = "xla"

    def attend(self, q, k_cache, v_cache, layer, meta: AttentionMetadata, *, scale, sliding_window=None):
        return paged_attention_chunked(
            q, k_cache, v_cache, layer, meta.page_tables, meta.token_seq_ids, meta.positions,
            scale=scale, sliding_window=sliding_window)


_BACKENDS = {"reference": ReferenceAttention, "xla": XlaAttention}


def get_attention_backend(name: str, platform: str):
    """Resolves `attention_backend=` ("auto", "xla", "reference", later "pallas") for a platform."""
    if name == "auto":
        # The Pallas kernels will take over on GPU once they land; the chunked XLA path serves everywhere.
        name = "xla"
    if name == "pallas":
        raise NotImplementedError(
            "attention_backend='pallas' arrives with the Pallas kernels issue; use 'reference' or 'auto'")
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose one of {['auto', *_BACKENDS]}")
    return _BACKENDS[name]()
