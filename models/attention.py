"""The attention-backend interface between the models and the kernels.

A backend writes the step's new K/V into the paged pool and computes attention for the packed query
tokens. Both calls take the whole stacked pool [L, Hkv, num_blocks, block_size, D] and a layer index.
Backends are stateless objects selected by name; the model calls them inside the jitted step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged.kernels import cpu, select_backends
from paged.kernels import (packed_causal_attention, paged_attention_chunked, paged_attention_reference,
                           paged_decode_attention, ragged_paged_attention, to_pool_dtype, write_kv_to_cache)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """What every attention kernel reads for one step: the contract between `paged/batch.py` and the backends.

    Arrays are host numpy when `paged/batch.py` builds them and device arrays inside the step, padded to the
    step's buckets: T tokens, S sequence rows, P pages per row (the full page-table width). Padded tokens
    write into the sink block and read as row 0 at position 0; padded rows have no tokens and length 0.

    Attributes:
      slot_mapping: int32 [T]; where each new token's K/V is written (block * block_size + offset).
      positions: int32 [T]; each token's position in its sequence.
      token_seq_ids: int32 [T]; the row of `page_tables` each token belongs to.
      page_tables: int32 [S, P]; block ids of each row's sequence, in order (0 = the sink block).
      query_start: int32 [S + 1]; packed offsets of each row's new tokens; query_start[-1] is the number of
        real tokens (tokens from it on are padding).
      seq_lens: int32 [S]; context length of each row after this step, new tokens included (0: padded row).
      num_decode_rows: int32 scalar; rows with exactly one new token.
      num_prefill_rows: int32 scalar; rows with more than one (prompts or prompt chunks).
      backend_data: whatever one backend alone needs, built from the fields above by its `prepare` hook on
        the host (None for backends that need nothing).
      rope_lengths: int32 [T]; the sequence length each token's rotary frequencies follow, for the rope
        scalings that depend on it (dynamic NTK, LongRoPE): its prompt's length while the prompt is computed,
        its own position + 1 after, as transformers' one forward per prompt then per token gives. None for
        every other model (no attention kernel reads it).
    """

    slot_mapping: Any
    positions: Any
    token_seq_ids: Any
    page_tables: Any
    query_start: Any
    seq_lens: Any
    num_decode_rows: Any
    num_prefill_rows: Any
    backend_data: Any = None
    rope_lengths: Any = None

    @classmethod
    def placeholder(cls) -> "AttentionMetadata":
        """One token, one sequence, one page: enough to trace a layer (e.g. for its parameter shapes)."""
        zeros = lambda *shape: jnp.zeros(shape, jnp.int32)
        return cls(slot_mapping=zeros(1), positions=zeros(1), token_seq_ids=zeros(1), page_tables=zeros(1, 1),
                   query_start=zeros(2), seq_lens=zeros(1), num_decode_rows=zeros(), num_prefill_rows=zeros())


class ReferenceAttention:
    """`jax.numpy` paged attention: gathers each token's pages and masks by position."""

    name = "reference"

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Host-side hook: fills `backend_data` from the common fields (numpy). Nothing for most backends."""
        return meta

    def check_model(self, model_config, dtype, kv_dtype, block_size: int) -> None:
        """Raises (NotImplementedError, ValueError) when this backend cannot run the model, naming why: called
        when the engine is built, not when the first step is traced. Every shape runs on most backends."""

    def write_kv(self, k_cache, v_cache, layer, k, v, meta: AttentionMetadata):
        if cpu.writes_pool_natively(k_cache.dtype):
            return cpu.write_kv_cpu(k_cache, v_cache, layer, k, v, meta.slot_mapping)
        return write_kv_to_cache(k_cache, v_cache, layer, k, v, meta.slot_mapping)

    def attend(self, q, k, v, k_cache, v_cache, layer, meta: AttentionMetadata, *, scale, sliding_window=None,
               soft_cap=None):
        """q [T, Hq, D]; k, v [T, Hkv, D] are the step's new keys and values (already in the pool)."""
        return paged_attention_reference(
            q, k_cache, v_cache, layer, meta.page_tables, meta.token_seq_ids, meta.positions,
            scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TailSplit:
    """XlaAttention's `backend_data`: whether tokens packed at index >= S may attend among the new tokens
    (plus the cached prefix of at most one sequence) instead of going through the pages one by one.

    Attributes:
      enabled: bool scalar; at most one row with tokens past the first S slots has cached context.
      prefix_seq: int32 scalar; that row (-1: none).
      prefix_len: int32 scalar; how many of its tokens were cached before this step.
    """

    enabled: Any
    prefix_seq: Any
    prefix_len: Any


class XlaAttention(ReferenceAttention):
    """XLA attention, the fast path on CPU.

    Paged attention with an online softmax over chunks of pages; and when the step allows it (`TailSplit`),
    only the first S token slots (one per sequence: the decode tokens come first) go through the pages, while
    the rest, prompt chunks, attend among the new tokens with one dense causal matrix plus, for at most one
    continuing prompt, its cached prefix read once for all its tokens: no per-token page gathers.
    """

    name = "xla"

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        num_rows = len(meta.seq_lens)
        query_lens = np.diff(meta.query_start)
        cached = meta.seq_lens - query_lens  # tokens each row had in the pool before this step
        tail_rows = np.flatnonzero((meta.query_start[1:] > num_rows) & (cached > 0) & (query_lens > 0))
        first = tail_rows[0] if len(tail_rows) else -1
        data = TailSplit(enabled=np.asarray(len(tail_rows) <= 1),
                         prefix_seq=np.asarray(first, np.int32),
                         prefix_len=np.asarray(cached[first] if len(tail_rows) else 0, np.int32))
        return dataclasses.replace(meta, backend_data=data)

    def paged_attention(self, q, k_cache, v_cache, layer, page_tables, token_seq_ids, positions, *, scale,
                        sliding_window, soft_cap):
        return paged_attention_chunked(q, k_cache, v_cache, layer, page_tables, token_seq_ids, positions,
                                       scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)

    def attend(self, q, k, v, k_cache, v_cache, layer, meta: AttentionMetadata, *, scale, sliding_window=None,
               soft_cap=None):
        if k_cache.dtype.itemsize == 1:  # fp8 pool: prompt tokens see each other as the pool holds them, too
            k, v = (to_pool_dtype(x, k_cache.dtype).astype(x.dtype) for x in (k, v))
        num_rows = meta.seq_lens.shape[0]
        paged = lambda rows: self.paged_attention(
            q[:rows], k_cache, v_cache, layer, meta.page_tables, meta.token_seq_ids[:rows], meta.positions[:rows],
            scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
        if num_rows == q.shape[0]:
            return paged(num_rows)

        def split(_):
            tail = meta.backend_data
            prefix_row = meta.page_tables[jnp.maximum(tail.prefix_seq, 0)]
            dense = packed_causal_attention(
                q, k, v, meta.token_seq_ids, meta.positions, scale=scale, sliding_window=sliding_window,
                soft_cap=soft_cap,
                k_cache=k_cache, v_cache=v_cache, layer=layer, prefix_page_row=prefix_row,
                prefix_seq_id=tail.prefix_seq, prefix_len=tail.prefix_len,
                num_real_tokens=meta.query_start[-1])
            return jnp.concatenate([paged(num_rows), dense[num_rows:]], axis=0)

        return jax.lax.cond(meta.backend_data.enabled, split, lambda _: paged(q.shape[0]), None)


class CpuKernelAttention(XlaAttention):
    """Every token through the native CPU kernel (pallas_kernels/cpu), prompt chunks included.

    The kernel takes each prompt chunk as tiles of consecutive tokens that read their pages once per tile,
    which beats the XLA path's dense causal matrix (quadratic in the step's tokens, mostly masked).
    float16 pools, which the kernel does not take, fall back to the XLA path.
    """

    name = "cpu"

    def __init__(self):
        ok, reason = cpu.available()
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
        return cpu.paged_attention_cpu(q, k_cache, v_cache, layer, page_tables, token_seq_ids, positions,
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

        return jax.lax.cond(meta.num_prefill_rows == 0, decode, ragged, None)


class MosaicPallasAttention(PallasAttention):
    """"pallas" with the Hopper decode kernel (Mosaic GPU: TMA + wgmma) for decode steps.

    bfloat16/float16 models only. Off a GPU it runs under the Mosaic GPU interpreter (jax >= 0.11), which
    is for tests at tiny sizes.
    """

    name = "pallas-mosaic"

    def check_model(self, model_config, dtype, kv_dtype, block_size: int) -> None:
        if np.dtype(kv_dtype).itemsize == 1:
            raise NotImplementedError("kv_cache_dtype='fp8' does not run on the pallas-mosaic decode kernel yet; "
                                      "use attention_backend='pallas'")
        from paged.kernels.gpu.decode_mgpu import hopper_unsupported
        c = model_config
        reason = hopper_unsupported(dtype, kv_dtype, c.head_dim, block_size, c.num_heads // c.num_kv_heads)
        if reason is not None:
            raise ValueError(f"attention_backend='pallas-mosaic' cannot run this model: {reason}; use "
                             "attention_backend='pallas'")

    def decode_kernel(self, q, k_cache, v_cache, page_tables, lengths, layer, sliding_window, scale, soft_cap):
        from paged.kernels.gpu.decode_mgpu import paged_decode_attention_mgpu  # Mosaic GPU: imported only when used
        interpret = jax.default_backend() == "cpu" if self.interpret is None else self.interpret
        return paged_decode_attention_mgpu(q, k_cache, v_cache, page_tables, lengths, layer, sliding_window,
                                           scale=scale, soft_cap=soft_cap, num_splits=self.decode_splits,
                                           interpret=interpret)


class PallasTpuAttention(ReferenceAttention):
    """The Mosaic TPU ragged kernel (pallas_kernels/tpu) for every step; on CPU under the TPU interpreter.

    Decode-only steps (decided on device, as for "pallas") run it with the smallest query block the TPU
    tiling allows, since each block holds one real token; steps with prompt tokens use the generation's
    prefill block. The pool write is XLA's scatter into the donated pool, which XLA does in place.
    """

    name = "pallas-tpu"

    def __init__(self, interpret=None, tokens_per_block: int | None = None, pages_per_step: int | None = None):
        self.interpret = interpret
        self.tokens_per_block = tokens_per_block
        self.pages_per_step = pages_per_step

    def attend(self, q, k, v, k_cache, v_cache, layer, meta: AttentionMetadata, *, scale, sliding_window=None,
               soft_cap=None):
        from paged.kernels.tpu.block_sizes import tokens_per_block_for
        from paged.kernels.tpu.ragged import ragged_paged_attention_tpu  # Mosaic TPU: imported only when used
        group = q.shape[1] // k_cache.shape[1]
        run = lambda tokens_per_block: ragged_paged_attention_tpu(
            q, k_cache, v_cache, meta.page_tables, meta.query_start, meta.seq_lens, layer, sliding_window,
            scale=scale, soft_cap=soft_cap, tokens_per_block=tokens_per_block, pages_per_step=self.pages_per_step,
            interpret=self.interpret)
        if self.tokens_per_block is not None:
            return run(self.tokens_per_block)
        decode_block = tokens_per_block_for(1, group, q.dtype)
        return jax.lax.cond(meta.num_prefill_rows == 0, lambda _: run(decode_block), lambda _: run(None), None)


class UserAttention(ReferenceAttention):
    """A registered `attend` function as a backend: the pool writes are the reference's."""

    def __init__(self, name: str, attend):
        self.name = name
        self._attend = attend

    def attend(self, q, k, v, k_cache, v_cache, layer, meta: AttentionMetadata, *, scale, sliding_window=None,
               soft_cap=None):
        return self._attend(q, k, v, k_cache, v_cache, layer, meta, scale=scale, sliding_window=sliding_window,
                            soft_cap=soft_cap)


_BACKENDS = {"reference": ReferenceAttention, "xla": XlaAttention, "cpu": CpuKernelAttention,
             "pallas": PallasAttention, "pallas-mosaic": MosaicPallasAttention, "pallas-tpu": PallasTpuAttention}
_REGISTERED: dict[str, Any] = {}  # name -> a factory of the backend object (paged.register_attention_backend)


def register_attention_backend(name: str, attend=None, *, backend=None) -> None:
    """Makes `attention_backend=name` run your attention (`LLM(...)`, `paged bench kernels --backend name`).

    attend: a function `attend(q, k, v, k_cache, v_cache, layer, meta, *, scale, sliding_window, soft_cap)`
      returning [T, Hq, D] in q's dtype, called inside the jitted step once per layer:
        q: [T, Hq, D] the step's queries (T padded to the step's bucket).
        k, v: [T, Hkv, D] the step's new keys and values, already written into the pool.
        k_cache, v_cache: [L, Hkv, num_blocks, block_size, D] the pool (block 0 is the padding sink).
        layer: int32 scalar, the layer to read.
        meta: `AttentionMetadata` (page tables, positions, row offsets; its docstring has every shape).
        scale: float; sliding_window: None or an int32 scalar (<= 0: none); soft_cap: None or a float.
      Outputs at padding tokens (index >= meta.query_start[-1]) are not read. `paged.testing.check_attention`
      checks a function against the float64 reference before you register it.
    backend: instead of `attend`, an object with the built-in backends' methods (`prepare`, `write_kv`,
      `attend`; see ReferenceAttention), for kernels that also write the pool or prepare host data.
    """
    if (attend is None) == (backend is None):
        raise ValueError("register_attention_backend takes exactly one of attend= or backend=")
    if not isinstance(name, str) or not name or name in _BACKENDS or name == "auto":
        raise ValueError(f"attention backend name must be a new non-empty string (not one of "
                         f"{['auto', *_BACKENDS]}), got {name!r}")
    if attend is not None and not callable(attend):
        raise ValueError(f"attend must be callable, got {type(attend).__name__}")
    _REGISTERED[name] = (lambda: UserAttention(name, attend)) if attend is not None else (lambda: backend)


def registered_attention_backends() -> tuple[str, ...]:
    return tuple(_REGISTERED)


def resolve_backends(platform: str, attention: str, linear: str, sharded: bool = False) -> tuple[str, str]:
    """`paged.kernels.select_backends`, knowing the registered backends too (their matmuls: as for "auto")."""
    if attention in _REGISTERED:
        return attention, select_backends(platform, "auto", linear, sharded)[1]
    return select_backends(platform, attention, linear, sharded)


def get_attention_backend(name: str, platform: str):
    """The backend object for `attention_backend=` on a platform ("auto" resolved by
    `paged.kernels.select_backends`), a registered one included."""
    if name in _REGISTERED:
        return _REGISTERED[name]()
    name, _ = select_backends(platform, name)
    return _BACKENDS[name]()
