"""Decode paged attention for Hopper GPUs, written for the Mosaic GPU backend (`plgpu.kernel`).

One program (one warpgroup, 128 threads) per (sequence, KV head, split), as in the portable kernel, but
with Hopper's own machinery:

- Pages arrive by TMA (bulk asynchronous copies) straight from the pool into shared memory, one copy per
  page into consecutive rows of a step's K (and V) tile, each with its own barrier. A ring of `stages`
  tiles keeps the next steps' copies in flight while the current step computes: decode is memory-bound,
  so the point is to keep HBM busy.
- Scores and the weighted sum run on the tensor cores (wgmma). wgmma works on 64-row tiles; the GQA group
  (padded to 64 rows) is one tile, so each page is read once for every query head of its KV head.
- Page ids are read from the page table in global memory as the copies are issued.

bfloat16 or float16 only (wgmma's input types); head_dim a multiple of 64; page_size a multiple of 8 (the
shared-memory tiling); at most 64 query heads per KV head.

Runs on CPU only under the Mosaic GPU interpreter (`interpret=True` here selects it), at small shapes:
it is orders of magnitude slower than plain interpret mode.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from paged.kernels.gpu.decode import default_num_splits, validate_decode_inputs
from paged.kernels.page_walk import MASK_VALUE, decode_page_range, layer_window_scalars, merge_splits

WGMMA_ROWS = 64
LOG2E = math.log2(math.e)


def gpu_interpret_params(detect_races: bool = True):
    """The Mosaic GPU interpreter's parameters (public in jax >= 0.12, private in 0.10)."""
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params(detect_races=detect_races)


def _transposed(ref):
    """ref.T for wgmma: `ref.transpose` in jax >= 0.12 (where `plgpu.transpose_ref` is deprecated)."""
    if hasattr(ref, "transpose"):
        return ref.transpose((1, 0))
    return plgpu.transpose_ref(ref, (1, 0))


def default_pages_per_step(page_size: int) -> int:
    """Pages per K/V tile: one wgmma's 64 keys where pages are smaller."""
    return max(1, 64 // page_size)


def hopper_unsupported(dtype, kv_dtype, head_dim: int, page_size: int, group: int,
                       pages_per_step: int | None = None) -> str | None:
    """Why this kernel cannot take these shapes (beyond the portable kernel's contract), or None if it can.
    The engine asks at start-up, before a step is traced."""
    pages_per_step = default_pages_per_step(page_size) if pages_per_step is None else pages_per_step
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16) or jnp.dtype(kv_dtype) != jnp.dtype(dtype):
        return (f"the Mosaic GPU kernel takes bfloat16 or float16 q and pool of one dtype; got {jnp.dtype(dtype)} "
                f"and {jnp.dtype(kv_dtype)}")
    if head_dim % 64:
        return f"head_dim must be a multiple of 64 for the Mosaic GPU kernel; got {head_dim}"
    if page_size % 8:
        return f"page_size must be a multiple of 8 for the Mosaic GPU kernel; got {page_size}"
    if group > WGMMA_ROWS:
        return f"at most {WGMMA_ROWS} query heads per KV head for the Mosaic GPU kernel; got {group}"
    if (pages_per_step * page_size) % 64:
        return f"pages_per_step * page_size must be a multiple of 64 keys; got {pages_per_step} x {page_size}"
    return None


def _validate_hopper(q, k_pages, pages_per_step):
    """What this kernel needs beyond the portable kernel's contract (checked there)."""
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads, page_size = k_pages.shape[1], k_pages.shape[3]
    reason = hopper_unsupported(q.dtype, k_pages.dtype, head_dim, page_size, num_q_heads // num_kv_heads,
                                pages_per_step)
    if reason is not None:
        raise ValueError(reason)


def _kernel(scalars_ref, lengths_ref, page_tables_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref,
            q_smem, k_smem, v_smem, p_smem, o_smem, ml_smem, q_barrier, k_barriers, v_barriers, *,
            scale, soft_cap, pages_per_step, pages_per_split, stages, normalise):
    """scalars_ref int32 [2] (layer, window); q_ref [S, Hkv, 64, D]; k_ref/v_ref [L, Hkv, N, bs, D] (GMEM);
    o_ref [splits, S, Hkv, 64, D]; m_ref/l_ref float32 [splits, S, Hkv, 64]. Scratch: q_smem [64, D];
    k_smem/v_smem [stages, keys_per_step, D]; p_smem [64, keys_per_step]; o_smem [64, D]; ml_smem f32 [2, 64]; barriers (one per page copy)."""
    seq, head, split = lax.axis_index("seq"), lax.axis_index("head"), lax.axis_index("split")
    layer, window = scalars_ref[0], scalars_ref[1]
    length = lengths_ref[seq]
    page_size = k_ref.shape[3]
    keys_per_step = pages_per_step * page_size
    dtype = q_smem.dtype

    first_key, start_page, end_page, num_steps = decode_page_range(length, window, split, pages_per_split,
                                                                    page_size, pages_per_step)

    def issue(step):
        """Starts the copies of `step`'s pages into its ring slot (pages past the row read page 0: masked)."""
        slot = lax.rem(step, stages)
        for p in range(pages_per_step):
            index = start_page + step * pages_per_step + p
            page = jnp.where(index < end_page, page_tables_ref[seq, jnp.minimum(index, pages_per_split *
                                                                                 (split + 1) - 1)], 0)
            rows = pl.ds(p * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_ref.at[layer, head, page], k_smem.at[slot, rows],
                                    k_barriers.at[slot * pages_per_step + p])
            plgpu.copy_gmem_to_smem(v_ref.at[layer, head, page], v_smem.at[slot, rows],
                                    v_barriers.at[slot * pages_per_step + p])

    plgpu.copy_gmem_to_smem(q_ref.at[seq, head], q_smem, q_barrier.at[0])
    for s in range(stages):
        pl.when(s < num_steps)(functools.partial(issue, s))
    plgpu.barrier_wait(q_barrier.at[0])

    def body(step, carry):
        acc, m, l = carry
        slot = lax.rem(step, stages)
        for p in range(pages_per_step):
            plgpu.barrier_wait(k_barriers.at[slot * pages_per_step + p])

        def scores(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, _transposed(k_smem.at[slot]))
            return acc_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((WGMMA_ROWS, keys_per_step), jnp.float32)) * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = (start_page + step * pages_per_step) * page_size + plgpu.broadcasted_iota(
            jnp.int32, (WGMMA_ROWS, keys_per_step), 1, layout=plgpu.Layout.WGMMA)
        visible = (key_pos < length) & (key_pos >= first_key) & (key_pos < end_page * page_size)
        s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp2((s - lax.broadcast_in_dim(m_new, s.shape, [0])) * LOG2E)
        p = jnp.where(visible, p, 0.0)
        correction = jnp.exp2((m - m_new) * LOG2E)
        l = l * correction + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])
        for q in range(pages_per_step):
            plgpu.barrier_wait(v_barriers.at[slot * pages_per_step + q])

        # The probabilities go through shared memory (the GPU interpreter's wgmma takes no register
        # operand), into a fresh zeroed accumulator added to the rescaled one (nor does it take
        # run_state(ACC.init(acc))). Both cost little next to the page copies in a memory-bound kernel.
        p_smem[...] = p.astype(dtype)
        plgpu.commit_smem()

        def weighted(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
            return acc_ref[...]

        acc = acc + pl.run_scoped(weighted, plgpu.ACC((WGMMA_ROWS, acc.shape[1]), jnp.float32))
        # The slot's tiles are consumed (wgmma has completed): refill it with a later step's pages.
        pl.when(step + stages < num_steps)(lambda: issue(step + stages))
        return acc, m_new, l

    head_dim = q_smem.shape[1]
    acc = plgpu.layout_cast(jnp.zeros((WGMMA_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    m = plgpu.layout_cast(jnp.full((WGMMA_ROWS,), MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l = plgpu.layout_cast(jnp.zeros((WGMMA_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc, m, l = lax.fori_loop(0, num_steps, body, (acc, m, l))
    if normalise:
        acc = acc / lax.broadcast_in_dim(jnp.where(l > 0, l, 1.0), acc.shape, [0])
    o_smem[...] = acc.astype(o_smem.dtype)
    ml_smem[0] = m
    ml_smem[1] = l
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[split, seq, head])
    plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ref.at[split, seq, head])
    plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ref.at[split, seq, head])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "pages_per_step", "num_splits", "stages",
                                             "interpret"))
def paged_decode_attention_mgpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    lengths: jax.Array,
    layer: jax.Array | int = 0,
    sliding_window: jax.Array | int | None = None,
    *,
    scale: float,
    soft_cap: float | None = None,
    pages_per_step: int | None = None,
    num_splits: int | None = None,
    stages: int = 3,
    interpret: bool = False,
) -> jax.Array:
    """Same contract as `paged_decode_attention` (see there); Hopper only, or the Mosaic GPU interpreter.

    Args (beyond the portable kernel's):
      num_splits: as there (default: enough programs to cover the GPU about twice; 1 on CPU).
      stages: ring depth of K/V tiles in shared memory (copies in flight ahead of the compute).
      interpret: run under the Mosaic GPU interpreter with race detection (CPU tests, small shapes).
    """
    if k_pages.ndim == 4:
        k_pages, v_pages = k_pages[None], v_pages[None]
    num_seqs, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, _ = k_pages.shape
    if pages_per_step is None:
        pages_per_step = default_pages_per_step(page_size)
    validate_decode_inputs(q, k_pages, v_pages, page_tables, lengths)
    _validate_hopper(q, k_pages, pages_per_step)
    group = num_q_heads // num_kv_heads
    keys_per_step = pages_per_step * page_size
    pages_per_seq = page_tables.shape[1]
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, pages_per_seq, pages_per_step)
    pages_per_split = pl.cdiv(pl.cdiv(pages_per_seq, num_splits), pages_per_step) * pages_per_step
    page_tables = jnp.pad(page_tables, ((0, 0), (0, num_splits * pages_per_split - pages_per_seq)))

    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, WGMMA_ROWS - group), (0, 0)))
    scalars = layer_window_scalars(layer, sliding_window)

    swizzle = 128 if head_dim * q.dtype.itemsize >= 128 else 64
    transforms = (plgpu.TilingTransform((8, swizzle // q.dtype.itemsize)), plgpu.SwizzleTransform(swizzle))
    p_swizzle = 128 if keys_per_step * q.dtype.itemsize >= 128 else 64
    p_transforms = (plgpu.TilingTransform((8, p_swizzle // q.dtype.itemsize)), plgpu.SwizzleTransform(p_swizzle))
    kernel = plgpu.kernel(
        functools.partial(_kernel, scale=scale, soft_cap=soft_cap, pages_per_step=pages_per_step,
                          pages_per_split=pages_per_split, stages=stages, normalise=num_splits == 1),
        out_type=[jax.ShapeDtypeStruct((num_splits, num_seqs, num_kv_heads, WGMMA_ROWS, head_dim),
                                       q.dtype if num_splits == 1 else jnp.float32),
                  jax.ShapeDtypeStruct((num_splits, num_seqs, num_kv_heads, WGMMA_ROWS), jnp.float32),
                  jax.ShapeDtypeStruct((num_splits, num_seqs, num_kv_heads, WGMMA_ROWS), jnp.float32)],
        scratch_types=[
            plgpu.SMEM((WGMMA_ROWS, head_dim), q.dtype, transforms=transforms),
            plgpu.SMEM((stages, keys_per_step, head_dim), q.dtype, transforms=transforms),
            plgpu.SMEM((stages, keys_per_step, head_dim), q.dtype, transforms=transforms),
            plgpu.SMEM((WGMMA_ROWS, keys_per_step), q.dtype, transforms=p_transforms),
            plgpu.SMEM((WGMMA_ROWS, head_dim), q.dtype if num_splits == 1 else jnp.float32),
            plgpu.SMEM((2, WGMMA_ROWS), jnp.float32),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=stages * pages_per_step),
            plgpu.Barrier(num_barriers=stages * pages_per_step),
        ],
        grid=(num_seqs, num_kv_heads, num_splits),
        grid_names=("seq", "head", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=gpu_interpret_params() if interpret else None,
    )
    out, m, l = kernel(scalars, lengths, page_tables, qg, k_pages, v_pages)
    if num_splits > 1:
        out = merge_splits(out, m[..., None], l[..., None])
    return out[0, :, :, :group].reshape(q.shape).astype(q.dtype)
