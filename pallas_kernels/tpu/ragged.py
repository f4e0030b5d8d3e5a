"""Ragged paged attention for TPU (Pallas, Mosaic TPU): decode rows, prompt chunks and prefix hits in one batch.

Same contract and arguments as `paged.kernels.gpu.ragged.ragged_paged_attention`; its `jax.numpy` twin is
`paged.kernels.reference.ragged_paged_attention_reference`. The step's packed query tokens are cut into
blocks of `tokens_per_block` tokens of one sequence (`page_walk.query_block_layout`); one program per
(query block, KV head) holds the block's tokens times the GQA group as one tile of rows, so each KV page is
loaded once per KV head for the whole group.

TPU specifics:
- The layout (each block's sequence, first position and token count), the flattened page tables and the
  (layer, window) scalars are scalar-prefetch operands: they sit in SMEM before the grid starts, so a program
  reads its page ids as scalars.
- The K/V pool stays in HBM (`memory_space=pl.ANY`). A program copies its pages into VMEM itself, by DMA,
  `pages_per_step` pages per step into one of two buffers: while it computes on one, the next step's pages
  are in flight into the other (each page has its own DMA semaphore). Pages past the block's last key are
  not copied; their buffer slots are masked (values zeroed) instead.
- Rows are group-major within a block (row = g * tokens_per_block + token), and tokens_per_block is a power
  of two, so a row's token is `row & (tokens_per_block - 1)`: no vector integer division.
- Scores, the online softmax and the accumulator are float32; Q.K^T and P.V run on the MXU in the pool's
  dtype (bfloat16 products accumulate in float32; float32 at HIGHEST precision).
- Rows that see no key (padding tokens, idle blocks, length-0 rows) give zeros, never NaN.
`block_sizes.py` has the tiling rules and the per-generation block sizes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from paged.kernels.page_walk import MASK_VALUE, layer_window_scalars, query_block_layout, validate_ragged_inputs
from paged.kernels.tpu.block_sizes import block_sizes, sublane_tile, tokens_per_block_for


def _validate(q, k_pages, v_pages, page_tables, query_start, seq_lens, tokens_per_block):
    """The ragged contract's checks, then what the TPU tiling adds."""
    validate_ragged_inputs(q, k_pages, v_pages, page_tables, query_start, seq_lens)
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages and v_pages must share a dtype; got {k_pages.dtype} and {v_pages.dtype}")
    tile = sublane_tile(k_pages.dtype)
    if k_pages.shape[3] % tile:
        raise ValueError(f"page_size must be a multiple of {tile} for a {k_pages.dtype} pool on TPU (its (sublane, "
                         f"lane) tile); got {k_pages.shape[3]}")
    if tokens_per_block is not None and (tokens_per_block < 1 or tokens_per_block & (tokens_per_block - 1)):
        raise ValueError(f"tokens_per_block must be a power of two; got {tokens_per_block}")


def _kernel(scalars_ref, block_seq_ref, block_first_pos_ref, block_num_tokens_ref, page_table_ref,
            q_ref, k_hbm, v_hbm, o_ref, k_buf, v_buf, sems, *, scale, soft_cap, tokens_per_block, pages_per_seq):
    """One (query block, KV head) program.

    Scalar prefetch (SMEM):
      scalars_ref: int32 [2]; (layer, sliding window; <= 0 means none).
      block_seq_ref, block_first_pos_ref, block_num_tokens_ref: int32 [NB]; each block's sequence row, the
        position of its first token, and how many of its tokens are real (0: an idle block).
      page_table_ref: int32 [S * pages_per_seq]; the page tables, row after row.
    q_ref, o_ref: [rows, D] (VMEM), rows = group * tokens_per_block, group-major.
    k_hbm, v_hbm: the pool [L, Hkv, N, page_size, D] (HBM).
    k_buf, v_buf: [2, pages_per_step, page_size, D] VMEM scratch in the pool's dtype (two step buffers).
    sems: DMA semaphores [2 (K, V), 2 (buffer), pages_per_step].
    """
    block, head = pl.program_id(0), pl.program_id(1)
    layer, window = scalars_ref[0], scalars_ref[1]
    seq = block_seq_ref[block]
    first_pos = block_first_pos_ref[block]
    num_tokens = block_num_tokens_ref[block]
    rows, head_dim = q_ref.shape
    _, pages_per_step, page_size, _ = k_buf.shape
    keys_per_step = pages_per_step * page_size

    # Every operand is >= 0: truncating division (lax.div) is floor division, without the sign fix-up jnp's
    # `//` lowers to.
    last_pos = first_pos + num_tokens - 1
    first_key = jnp.where(window > 0, jnp.maximum(first_pos - window + 1, 0), 0)
    start_page = jax.lax.div(first_key, page_size)
    end_page = jnp.where(num_tokens > 0, jax.lax.div(last_pos + page_size, page_size), start_page)
    num_steps = jax.lax.div(end_page - start_page + pages_per_step - 1, pages_per_step)

    def page_copies(step, slot, j):
        index = start_page + step * pages_per_step + j
        page = page_table_ref[seq * pages_per_seq + jnp.minimum(index, pages_per_seq - 1)]
        return (pltpu.make_async_copy(k_hbm.at[layer, head, page], k_buf.at[slot, j], sems.at[0, slot, j]),
                pltpu.make_async_copy(v_hbm.at[layer, head, page], v_buf.at[slot, j], sems.at[1, slot, j]))

    def for_each_copy(step, slot, action):
        for j in range(pages_per_step):  # static: one DMA per page and pool
            @pl.when(start_page + step * pages_per_step + j < end_page)
            def _():
                for copy in page_copies(step, slot, j):
                    getattr(copy, action)()

    @pl.when(num_steps > 0)
    def _():
        for_each_copy(0, 0, "start")

    row_token = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) & (tokens_per_block - 1)
    row_pos = first_pos + row_token
    row_real = row_token < num_tokens
    q = q_ref[...]
    if q.dtype != k_buf.dtype:  # an 8-bit pool: its pages are widened to the queries' dtype for the MXU
        q = q.astype(jnp.float32)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def body(step, carry):
        m, l, acc = carry
        slot = jax.lax.rem(step, 2)

        @pl.when(step + 1 < num_steps)
        def _():
            for_each_copy(step + 1, 1 - slot, "start")

        for_each_copy(step, slot, "wait")
        page0 = start_page + step * pages_per_step
        k = k_buf[slot].reshape(keys_per_step, head_dim).astype(q.dtype)
        v = v_buf[slot].reshape(keys_per_step, head_dim).astype(q.dtype)
        key_pos = page0 * page_size + jax.lax.broadcasted_iota(jnp.int32, (1, keys_per_step), 1)
        # Buffer slots of pages not copied this step hold stale or uninitialised data: zero their values so
        # 0 x garbage never reaches the accumulator (their scores are masked below).
        copied = page0 * page_size + jax.lax.broadcasted_iota(jnp.int32, (keys_per_step, 1), 0) < end_page * page_size
        v = jnp.where(copied, v, 0)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                precision=precision) * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        visible = (key_pos <= row_pos) & row_real & ((key_pos > row_pos - window) | (window <= 0))
        s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
        p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=1, keepdims=True)
        acc = acc * correction + jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                                     preferred_element_type=jnp.float32, precision=precision)
        return m_new, l, acc

    init = (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_steps, body, init)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def interpret_params(detect_races: bool = False):
    """The TPU interpreter's settings (Pallas on CPU): uninitialised memory reads as NaN, so a kernel that
    reads what it never wrote shows it; `detect_races` checks every DMA against the reads and writes of its
    buffers."""
    return pltpu.InterpretParams(detect_races=detect_races, uninitialized_memory="nan")


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "tokens_per_block", "pages_per_step",
                                             "interpret", "vmem_limit_bytes"))
def ragged_paged_attention_tpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    query_start: jax.Array,
    seq_lens: jax.Array,
    layer: jax.Array | int = 0,
    sliding_window: jax.Array | int | None = None,
    *,
    scale: float,
    soft_cap: float | None = None,
    tokens_per_block: int | None = None,
    pages_per_step: int | None = None,
    interpret=None,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
    """Causal attention of packed new tokens over their sequences' paged context, on TPU.

    Args:
      q: [num_tokens, num_q_heads, head_dim] float32 or bfloat16; sequence s owns tokens
        query_start[s]:query_start[s + 1], at positions seq_lens[s] - n_s .. seq_lens[s] - 1. Tokens from
        query_start[-1] on are padding: their output is zeros.
      k_pages, v_pages: [num_layers, num_kv_heads, num_pages, page_size, head_dim] (or without the layer
        axis), float32, bfloat16 or float8; the pool, with this step's K/V already written. page_size a
        multiple of the dtype's sublane tile (8, 16 or 32).
      page_tables: int32 [num_seqs, pages_per_seq]; every entry a valid page id (0, the sink, for unused).
      query_start: int32 [num_seqs + 1]; non-decreasing packed offsets, query_start[0] = 0.
      seq_lens: int32 [num_seqs]; context length of each row including its new tokens (0: padded row).
      layer: int32 scalar; the layer of the pool to read.
      sliding_window: int or int32 scalar (may be traced); a query at position p sees keys > p - window;
        None or <= 0: all.
      scale: softmax scale. soft_cap: optional logit soft cap.
      tokens_per_block: query tokens per program, a power of two (default: from `block_sizes`, for a
        prefill-shaped block; the engine passes a small one for decode-only steps).
      pages_per_step: pages per double-buffered DMA step (default: the generation's keys_per_step).
      interpret: None (on CPU: the TPU interpreter; on TPU: compiled), False, True, or
        `interpret_params(...)`.
      vmem_limit_bytes: Mosaic's scoped VMEM limit (default: the generation's table entry).

    Returns:
      [num_tokens, num_q_heads, head_dim] in q's dtype.
    """
    if k_pages.ndim == 4:
        k_pages, v_pages = k_pages[None], v_pages[None]
    _validate(q, k_pages, v_pages, page_tables, query_start, seq_lens, tokens_per_block)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if interpret is True:
        interpret = interpret_params()
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_pages.shape[1], k_pages.shape[3]
    group = num_q_heads // num_kv_heads
    sizes = block_sizes("cpu" if interpret else None)
    if tokens_per_block is None:
        tokens_per_block = tokens_per_block_for(sizes.prefill_rows, group, q.dtype)
    if (tokens_per_block * group) % sublane_tile(q.dtype):
        raise ValueError(f"tokens_per_block x group = {tokens_per_block} x {group} must be a multiple of "
                         f"{sublane_tile(q.dtype)} for {q.dtype} queries")
    if pages_per_step is None:
        pages_per_step = max(1, sizes.keys_per_step // page_size)
    rows = group * tokens_per_block
    pages_per_seq = page_tables.shape[1]

    num_blocks, layout, (token_block, token_slot, token_real) = query_block_layout(
        query_start, seq_lens, num_tokens, tokens_per_block)
    # Packed tokens -> [NB, Hkv, group * tokens_per_block, D], group-major (slots with no token hold zeros).
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    blocks = jnp.zeros((num_blocks, num_kv_heads, group, tokens_per_block, head_dim), q.dtype)
    blocks = blocks.at[jnp.where(token_real, token_block, num_blocks), :, :, token_slot].set(qg, mode="drop")
    blocks = blocks.reshape(num_blocks, num_kv_heads, rows, head_dim)

    block_spec = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, *_: (b, h, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(num_blocks, num_kv_heads),
        in_specs=[block_spec, any_spec, any_spec],
        out_specs=block_spec,
        scratch_shapes=[pltpu.VMEM((2, pages_per_step, page_size, head_dim), k_pages.dtype),
                        pltpu.VMEM((2, pages_per_step, page_size, head_dim), k_pages.dtype),
                        pltpu.SemaphoreType.DMA((2, 2, pages_per_step))])
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, soft_cap=soft_cap, tokens_per_block=tokens_per_block,
                          pages_per_seq=pages_per_seq),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(blocks.shape, q.dtype),
        interpret=interpret if interpret else False,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=vmem_limit_bytes or sizes.vmem_limit_bytes),
        name="ragged_paged_attention_tpu",
    )(layer_window_scalars(layer, sliding_window), *layout, page_tables.reshape(-1), blocks, k_pages, v_pages)

    out = out.reshape(num_blocks, num_kv_heads, group, tokens_per_block, head_dim)
    out = out[token_block, :, :, token_slot]  # [T, Hkv, group, D]
    out = jnp.where(token_real[:, None, None, None], out, 0)
    return out.reshape(num_tokens, num_q_heads, head_dim)
