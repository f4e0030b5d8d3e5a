"""Pooling: a step's per-token hidden states reduced to one vector per sequence on the device, then finished
on the host per request (Matryoshka truncation, normalisation, the classifier's activation).

A pooling engine runs every prompt whole in one step (no chunked prefill, no prefix cache: each reduction
sees all of its sequence's tokens), so what comes back is final: [S, H] for embeddings, [S, num_labels] for a
classifier, never [T, H].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from paged.pooling_params import PoolerConfig, PoolingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PoolerOutput:
    """data float32 [S, D]: each row's pooled vector (D: the hidden size, or the classifier's labels)."""

    data: jax.Array


def pool_tokens(hidden: jax.Array, token_seq_ids: jax.Array, query_start: jax.Array, pooling_type: str) -> jax.Array:
    """Reduces the step's packed hidden states to one float32 row per sequence.

    Args:
      hidden: [T, H], the final hidden state of every packed token.
      token_seq_ids: int32 [T], the row each token belongs to (padding tokens: any, they are masked).
      query_start: int32 [S + 1], where each row's tokens start; query_start[-1] is the live token count.
      pooling_type: "LAST", "MEAN" or "CLS" (static).
    Returns:
      float32 [S, H]; a padding row (no tokens) gets zeros for MEAN, and an arbitrary row otherwise.
    """
    num_seqs = query_start.shape[0] - 1
    if pooling_type == "LAST":
        return hidden[jnp.maximum(query_start[1:] - 1, 0)].astype(jnp.float32)
    if pooling_type == "CLS":
        return hidden[jnp.minimum(query_start[:-1], hidden.shape[0] - 1)].astype(jnp.float32)
    if pooling_type == "MEAN":
        live = jnp.arange(hidden.shape[0]) < query_start[-1]
        rows = jnp.where(live, token_seq_ids, num_seqs)  # padding goes out of range and is dropped
        sums = jnp.zeros((num_seqs, hidden.shape[1]), jnp.float32).at[rows].add(hidden.astype(jnp.float32),
                                                                                  mode="drop")
        counts = jnp.maximum(query_start[1:] - query_start[:-1], 1).astype(jnp.float32)
        return sums / counts[:, None]
    raise ValueError(f"pooling_type must be one of LAST, MEAN, CLS; got {pooling_type!r}")


def finish_embedding(vector: np.ndarray, params: PoolingParams, config: PoolerConfig) -> np.ndarray:
    """One request's embedding from its pooled float32 [H]: truncated to `dimensions`, then normalised (both as
    the request asks, else as the model's pooler config says), as vLLM orders them."""
    dimensions = params.dimensions if params.dimensions is not None else config.dimensions
    if dimensions is not None:
        vector = vector[:dimensions]
    normalize = params.use_activation if params.use_activation is not None else config.use_activation
    if normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector


def finish_scores(logits: np.ndarray, params: PoolingParams, config: PoolerConfig) -> np.ndarray:
    """One request's classifier output from its float32 [num_labels] logits: a sigmoid for a single label, a
    softmax over several, or the raw logits when activation is off."""
    use_activation = params.use_activation if params.use_activation is not None else config.use_activation
    if use_activation is False:
        return logits
    logits = logits.astype(np.float64)
    if logits.shape[-1] == 1:
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    shifted = np.exp(logits - logits.max())
    return (shifted / shifted.sum()).astype(np.float32)
