"""The encoders' own attention (models/bert.py `segment_attention`) against a float64 numpy reference: packed
sequences of mixed lengths (within a tile, across tiles, longer than several tiles), padding tokens, and the
token-type bits. Needs no torch: it runs on every jax the project supports."""

from __future__ import annotations

import numpy as np
import pytest

from paged.models.bert import segment_attention


def reference(q, k, v, lengths, scale):
    out, start = np.zeros_like(q), 0
    for n in lengths:
        s = np.einsum("qhd,khd->hqk", q[start:start + n], k[start:start + n]) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[start:start + n] = np.einsum("hqk,khd->qhd", p, v[start:start + n])
        start += n
    return out


@pytest.mark.parametrize("lengths, padded, block", [
    ([5, 1, 7], 16, 4),            # several sequences inside one tile, and padding
    ([3, 20, 2, 9], 40, 8),        # a sequence spanning tiles; tiles shared by two sequences
    ([70], 96, 16),                # one long sequence over many tiles
    ([1] * 12, 12, 64),            # one tile larger than the step
])
def test_segment_attention_matches_per_sequence_reference(lengths, padded, block):
    rng = np.random.default_rng(len(lengths) + padded)
    heads, dim = 3, 8
    q, k, v = (rng.standard_normal((padded, heads, dim)) for _ in range(3))
    seq_ids = np.zeros(padded, np.int32)
    seq_ids[:sum(lengths)] = np.repeat(np.arange(len(lengths)), lengths)
    query_start = np.zeros(len(lengths) + 1, np.int32)
    query_start[1:] = np.cumsum(lengths)
    got = np.asarray(segment_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                                       seq_ids, query_start, scale=dim ** -0.5, block=block))
    live = sum(lengths)
    np.testing.assert_allclose(got[:live], reference(q, k, v, lengths, dim ** -0.5)[:live], atol=2e-5)
    assert np.all(got[live:] == 0) and np.all(np.isfinite(got))
