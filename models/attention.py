"""The attention-backend interface between the models and the kernels.

A backend writes the step's new K/V into the paged pool and computes attention for the packed query
tokens. Both calls take the whole stacked pool [L, Hkv, num_blocks, block_size, D] and a layer index.
Backends are stateless objects selected by name; the model calls them inside the jitted step.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_kernel
from pallas_kernels import (packed_causal_attention, paged_attention_chunked, paged_attention_reference,
                            paged_decode_attention, ragged_paged_attention, write_kv_to_cache)


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
      tail_split: bool scalar; tokens packed at index >= S may attend among the new tokens (plus the cached
        prefix of at most one sequence, `tail_prefix_seq`) instead of going through the pages one by one.
      tail_prefix_seq: int32 scalar; that sequence's row in `page_tables` (-1: none).
      tail_prefix_len: int32 scalar; how many of its tokens were cached before this step.
    """

    slot_mapping: jax.Array
    positions: jax.Array
    token_seq_ids: jax.Array
    page_tables: jax.Array
    query_start: jax.Array
    seq_lens: jax.Array
    tail_split: jax.Array
    tail_prefix_seq: jax.Array
    tail_prefix_len: jax.Array

    @classmethod
    def placeholder(cls) -> "AttentionMetadata":
        """One token, one sequence, one page: enough to trace a layer (e.g. for its parameter shapes)."""
        zeros = lambda *shape: jnp.zeros(shape, jnp.int32)
        return cls(slot_mapping=zeros(1), positions=zeros(1), token_seq_ids=zeros(1), page_tables=zeros(1, 1),
                   query_start=zeros(2), seq_lens=zeros(1), tail_split=jnp.zeros((), bool),
                   tail_prefix_seq=zeros(), tail_prefix_len=zeros())


class ReferenceAttention:
    """`jax.numpy` paged attention: gathers each token's pages and masks by position."""

    name = "reference"
    # A backend may also supply the matmul of the model's dense projections (None: XLA's dot).
    dot_general = None

    @staticmethod
    def live_rows(padded_rows: int, live: jax.Array):
        """A context in which `dot_general`'s products over `padded_rows` rows may skip the rows from `live`
        (int32 scalar) on: the model wraps the parts whose rows are the step's padded tokens or sequences
        in it. Rows it skips come out as zeros; with XLA's dot nothing is skipped."""
        del padded_rows, live
        return contextlib.nullcontext()

    def write_kv(self, k_cache, v_cache, layer, k, v, meta: AttentionMetadata):
        return write_kv_to_cache(k_cache, v_cache, layer, k, v, meta.slot_mapping)

    def attend(self, q, k, v, k_cache, v_cache, layer, meta: AttentionMetadata, *, scale, sliding_window=None,
               soft_cap=None):
        """q [T, Hq, D]; k, v [T, Hkv, D] are the step's new keys and values (already in the pool)."""
        return paged_attention_reference(
            q, k_cache, v_cache, layer, meta.page_tables, meta.token_seq_ids, meta.positions,
            scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)


class XlaAttention(ReferenceAttention):
    """XLA attention, the fast path on CPU.

    Paged attention with an online softmax over chunks of pages; and when the step allows it (`tail_split`),
    only the first S token slots (one per sequence: the decode tokens come first) go through the pages, while
    the rest, prompt chunks, attend among the new tokens with one dense causal matrix plus, for at most one
    continuing prompt, its cached prefix read once for all its tokens: no per-token page gathers.
    """

    name = "xla"

    def paged_attention(self, q, k_cache, v_cache, layer, page_tables, token_seq_ids, positions, *, scale,
                        sliding_window, soft_cap):
        return paged_attention_chunked(q, k_cache, v_cache, layer, page_tables, token_seq_ids, positions,
                                       scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)

    def attend(self, q, k, v, k_cache, v_cache, layer, meta: AttentionMetadata, *, scale, sliding_window=None,
               soft_cap=None):
        num_rows = meta.seq_lens.shape[0]
        paged = lambda rows: self.paged_attention(
            q[:rows], k_cache, v_cache, layer, meta.page_tables, meta.token_seq_ids[:rows], meta.positions[:rows],
            scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
        if num_rows == q.shape[0]:
            return paged(num_rows)

        def split(_):
            prefix_row = meta.page_tables[jnp.maximum(meta.tail_prefix_seq, 0)]
            dense = packed_causal_attention(
                q, k, v, meta.token_seq_ids, meta.positions, scale=scale, sliding_window=sliding_window,
                soft_cap=soft_cap,
                k_cache=k_cache, v_cache=v_cache, layer=layer, prefix_page_row=prefix_row,
                prefix_seq_id=meta.tail_prefix_seq, prefix_len=meta.tail_prefix_len,
                num_real_tokens=meta.query_start[-1])
            return jnp.concatenate([paged(num_rows), dense[num_rows:]], axis=0)

        return jax.lax.cond(meta.tail_split, split, lambda _: paged(q.shape[0]), None)


class CpuKernelAttention(XlaAttention):
    """Every token through the native CPU kernel (pallas_kernels/cpu_kernel.py), prompt chunks included;
    and the native matmul for the dense projections of decode-sized steps.

    The kernel takes each prompt chunk as tiles of consecutive tokens that read their pages once per tile,
    which beats the XLA path's dense causal matrix (quadratic in the step's tokens, mostly masked).
    float16 pools, which the kernel does not take, fall back to the XLA path.
    """

    name = "cpu"
    # Decode-sized float32 projections go to the native matmul (pallas_kernels/cpu/matmul.cc), which skips
    # the rows of padding that `live_rows` marks.
    dot_general = staticmethod(cpu_kernel.dense_dot_general)
    live_rows = staticmethod(cpu_kernel.live_rows)

    def __init__(self):
        ok, reason = cpu_kernel.available()
        if not ok:
            raise RuntimeError(f"attention_backend='cpu' needs the native CPU kernel, which is unavailable: "
                               f"{reason}")

    @staticmethod
    def _kernel_takes(q, k_cache) -> bool:
        return q.dtype in (jnp.float32, jnp.bfloat16) and k_cache.dtype == q.dtype

    def attend(self, q, k, v, k_cache, v_cache, layer, meta: AttentionMetadata, *, scale, sliding_window=None,
               soft_cap=None):
        if not self._kernel_takes(q, k_cache):
            return super().attend(q, k, v, k_cache, v_cache, layer, meta, scale=scale,
                                  sliding_window=sliding_window, soft_cap=soft_cap)
        return self.paged_attention(q, k_cache, v_cache, layer, meta.page_tables, meta.token_seq_ids,
                                    meta.positions, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)

    def paged_attention(self, q, k_cache, v_cache, layer, page_tables, token_seq_ids, positions, *, scale,
                        sliding_window, soft_cap):
        if not self._kernel_takes(q, k_cache):
            return super().paged_attention(q, k_cache, v_cache, layer, page_tables, token_seq_ids, positions,
                                           scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
        return cpu_kernel.paged_attention_cpu(q, k_cache, v_cache, layer, page_tables, token_seq_ids, positions,
                                              scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)


class PallasAttention(ReferenceAttention):
    """The Pallas kernels: the decode kernel when every sequence has one new token, else the ragged one.

    Which one runs is decided on device (`lax.cond` on the step's longest query), so decode steps get the
    split-KV decode kernel without a second compiled step. On CPU the kernels run in interpret mode.
    """

    name = "pallas"

    def __init__(self, interpret: bool | None = None, decode_splits: int | None = None):
        self.interpret = interpret
        self.decode_splits = decode_splits

    def decode_kernel(self, q, k_cache, v_cache, page_tables, lengths, layer, sliding_window, scale, soft_cap):
        return paged_decode_attention(q, k_cache, v_cache, page_tables, lengths, layer, sliding_window, scale=scale,
                                      soft_cap=soft_cap, num_splits=self.decode_splits, interpret=self.interpret)

    def attend(self, q, k, v, k_cache, v_cache, layer, meta: AttentionMetadata, *, scale, sliding_window=None,
               soft_cap=None):
        q_lens = meta.query_start[1:] - meta.query_start[:-1]
        num_real = meta.query_start[-1]
        real_token = jnp.arange(q.shape[0]) < num_real

        def decode(_):
            first_token = jnp.clip(meta.query_start[:-1], 0, q.shape[0] - 1)
            lengths = jnp.where(q_lens > 0, meta.seq_lens, 0)
            out = self.decode_kernel(q[first_token], k_cache, v_cache, meta.page_tables, lengths, layer,
                                     sliding_window, scale, soft_cap)
            return jnp.where(real_token[:, None, None], out[meta.token_seq_ids], 0).astype(q.dtype)

        def ragged(_):
            return ragged_paged_attention(
                q, k_cache, v_cache, meta.page_tables, meta.query_start, meta.seq_lens, layer, sliding_window,
                scale=scale, soft_cap=soft_cap, interpret=self.interpret)

        return jax.lax.cond(jnp.max(q_lens) <= 1, decode, ragged, None)


class MosaicPallasAttention(PallasAttention):
    """"pallas" with the Hopper decode kernel (Mosaic GPU: TMA + wgmma) for decode steps.

    bfloat16/float16 models only. Off a GPU it runs under the Mosaic GPU interpreter (jax >= 0.12), which
    is for tests at tiny sizes.
    """

    name = "pallas-mosaic"

    def decode_kernel(self, q, k_cache, v_cache, page_tables, lengths, layer, sliding_window, scale, soft_cap):
        from pallas_kernels.decode_mgpu import paged_decode_attention_mgpu  # Mosaic GPU: imported only when used
        interpret = jax.default_backend() == "cpu" if self.interpret is None else self.interpret
        return paged_decode_attention_mgpu(q, k_cache, v_cache, page_tables, lengths, layer, sliding_window,
                                           scale=scale, soft_cap=soft_cap, num_splits=self.decode_splits,
                                           interpret=interpret)


_BACKENDS = {"reference": ReferenceAttention, "xla": XlaAttention, "cpu": CpuKernelAttention,
             "pallas": PallasAttention, "pallas-mosaic": MosaicPallasAttention}


def get_attention_backend(name: str, platform: str):
    """Resolves `attention_backend=` ("auto", "pallas", "cpu", "xla", "reference") for a platform.

    "auto" picks the Pallas kernels on GPU; on CPU the native kernel when it builds here, else the chunked
    XLA path (Pallas kernels would run in interpret mode: correct, but a sequential loop over the grid).
    """
    if name == "auto":
        if platform in ("gpu", "cuda", "rocm"):
            name = "pallas"
        else:  # the native kernel when this machine can build it; else XLA's chunked loop
            name = "cpu" if platform == "cpu" and cpu_kernel.available()[0] else "xla"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose one of {['auto', *_BACKENDS]}")
    if name == "cpu" and platform != "cpu":  # its FFI target exists only for the host platform
        raise ValueError(f"attention_backend='cpu' runs on the CPU only; this engine runs on {platform!r}")
    return _BACKENDS[name]()
