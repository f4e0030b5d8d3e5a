"""Random paged inputs and a float64 numpy reference shared by the kernel tests."""

from __future__ import annotations

import dataclasses

import numpy as np

NUM_LAYERS = 2
LAYER = 1  # read a layer other than 0 so a kernel that ignores `layer` fails

# (num_q_heads, num_kv_heads): GQA ratios 1, 2, 4, 8 and MQA.
HEAD_CONFIGS = [(2, 2), (4, 2), (8, 2), (16, 2), (4, 1)]
HEAD_IDS = ["mha", "gqa2", "gqa4", "gqa8", "mqa"]


@dataclasses.dataclass
class PagedInputs:
    k_pages: np.ndarray  # [L, Hkv, N, bs, D]
    v_pages: np.ndarray
    page_tables: np.ndarray  # int32 [S, P], a random permutation of the pool's pages

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[3]

    def keys(self, seq: int, length: int, head: int) -> tuple[np.ndarray, np.ndarray]:
        """The first `length` keys and values of a sequence for one KV head, float64 [length, D]."""
        pages = self.page_tables[seq]
        k = self.k_pages[LAYER, head, pages].reshape(-1, self.k_pages.shape[-1])[:length]
        v = self.v_pages[LAYER, head, pages].reshape(-1, self.v_pages.shape[-1])[:length]
        return k.astype(np.float64), v.astype(np.float64)


def random_pool(rng, num_seqs, pages_per_seq, num_kv_heads, page_size, head_dim, dtype, spare_pages=3):
    """A pool with a few pages no sequence owns; every table is a random permutation of the pages."""
    num_pages = num_seqs * pages_per_seq + spare_pages
    shape = (NUM_LAYERS, num_kv_heads, num_pages, page_size, head_dim)
    k = rng.normal(size=shape).astype(dtype)
    v = rng.normal(size=shape).astype(dtype)
    tables = rng.permutation(num_pages)[:num_seqs * pages_per_seq].reshape(num_seqs, pages_per_seq)
    return PagedInputs(k, v, tables.astype(np.int32))


def attention_f64(q, k, v, positions, scale, window=None, soft_cap=None):
    """q [n, Hq, D] at `positions`; k, v [Hkv][ctx, D] float64 lists per KV head; causal softmax."""
    num_q_heads = q.shape[1]
    group = num_q_heads // len(k)
    out = np.zeros(q.shape, np.float64)
    for i, pos in enumerate(positions):
        lo = 0 if window is None or window <= 0 else max(0, pos - window + 1)
        for h in range(num_q_heads):
            kh, vh = k[h // group][lo:pos + 1], v[h // group][lo:pos + 1]
            s = kh @ q[i, h].astype(np.float64) * scale
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ vh
    return out


def tolerance(dtype) -> dict:
    """float32: the kernel accumulates in float32 over at most a few hundred keys, so errors stay near
    1e-6; 2e-5 leaves room without hiding a wrong key (which moves outputs by ~1e-1).
    bfloat16: inputs are the same bf16 values in both; the kernel computes in float32 and rounds its
    output once to bf16 (relative step 2^-8 = 3.9e-3), so 1.6e-2 is about four output ulps. Prompt chunks on
    AMX tiles also round each probability to bf16 before the PV product (relative 2^-9): an output moves by at
    most 2^-9 of the largest value it averages (|v| < 5 here, so < 1e-2), and typically far less."""
    return dict(atol=2e-5, rtol=2e-5) if dtype == np.float32 else dict(atol=1.6e-2, rtol=1.6e-2)


# The ragged kernels' batches: PAGES_PER_SEQ pages per table row, PADDING_TOKENS padding tokens at the end.
PAGES_PER_SEQ = 5
PADDING_TOKENS = 3


def ragged_batch(page_size):
    """(new tokens, context length) per sequence: a fresh one-token prompt, decodes at a page boundary and
    at the maximum, a padded row, a whole prompt ending mid-page, a chunk continuing a cached prefix, and
    a chunk that fills the table."""
    top = PAGES_PER_SEQ * page_size
    return [(1, 1), (1, page_size), (1, top), (0, 0), (2 * page_size + 3, 2 * page_size + 3),
            (page_size + 1, 3 * page_size), (page_size, top)]


def ragged_f64(q, inputs, seqs, query_start, scale, window=None, soft_cap=None):
    num_kv_heads = inputs.k_pages.shape[1]
    out = np.zeros(q.shape, np.float64)
    for s, (n, ctx) in enumerate(seqs):
        if n == 0:
            continue
        kv = [inputs.keys(s, ctx, h) for h in range(num_kv_heads)]
        rows = slice(query_start[s], query_start[s + 1])
        out[rows] = attention_f64(q[rows], [k for k, _ in kv], [v for _, v in kv], range(ctx - n, ctx), scale,
                                  window, soft_cap)
    return out


def random_ragged_args(rng, window):
    """A random ragged batch as the kernels take it (6 rows of random context and chunk lengths, 5 padding
    tokens): (q, k_pages, v_pages, page_tables, query_start, seq_lens, layer, window)."""
    import jax.numpy as jnp
    inputs = random_pool(rng, 6, 8, 2, 16, 64, np.float32)
    ctx = rng.integers(1, 8 * 16 + 1, size=6)
    q_lens = np.minimum(rng.integers(1, 40, size=6), ctx)
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(int(query_start[-1]) + 5, 8, 64)).astype(np.float32))
    return (q, inputs.k_pages, inputs.v_pages, inputs.page_tables, jnp.asarray(query_start),
            jnp.asarray(ctx, jnp.int32), LAYER, window)
