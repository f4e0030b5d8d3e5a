"""Block sizes of the TPU ragged kernel per TPU generation, and the layout rules they obey.

TPU vector registers hold (8, 128) tiles of 32-bit values and (16, 128) of 16-bit ones (two rows packed per
sublane); VMEM arrays are laid out in those tiles. So:
- a query block has `rows` = tokens_per_block x GQA group rows, a multiple of 8 (float32) or 16 (bfloat16):
  tokens_per_block is a power of two chosen so that it is, for any group;
- a K/V page is a [page_size, head_dim] tile: page_size must be a multiple of 8 (float32), 16 (16-bit) or 32
  (8-bit pools);
- head_dim 128 fills the 128 lanes. head_dim 64 is taken as it is, not padded: a page then fills half of
  each tile's lanes (twice the VMEM per key) and Q.K^T contracts over half the MXU's depth; padding the pool
  to 128 would double its HBM bytes, which decode is bound by, so the half-filled tile is the cheaper cost.

The table gives, per generation, how many query rows a prefill block targets (about the MXU's width times
two, so a block's Q.K^T fills it) and how many keys one double-buffered step copies. They are starting
points from each chip's MXU shape and VMEM, not yet measured on a TPU: `BLOCK_SIZES[...] = TpuBlockSizes(...)`
or the kernel's `tokens_per_block` / `pages_per_step` arguments override them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class TpuBlockSizes:
    prefill_rows: int  # query rows (tokens x GQA group) per program when the step has prompt tokens
    keys_per_step: int  # keys copied per double-buffered step (K and V each)
    vmem_limit_bytes: int | None = None  # Mosaic's scoped VMEM limit for the kernel (None: its default)


# device_kind substrings (jax.devices()[0].device_kind) -> sizes; the first that matches wins.
BLOCK_SIZES: dict[str, TpuBlockSizes] = {
    "v6": TpuBlockSizes(prefill_rows=512, keys_per_step=512),  # Trillium: 256x256 MXUs, 32 GiB HBM
    "v5p": TpuBlockSizes(prefill_rows=256, keys_per_step=512),  # 128x128 MXUs, 95 GiB HBM
    "v5": TpuBlockSizes(prefill_rows=256, keys_per_step=256),  # v5e ("TPU v5 lite"): 128x128 MXUs, 16 GiB
    "v4": TpuBlockSizes(prefill_rows=256, keys_per_step=256),
}
DEFAULT = TpuBlockSizes(prefill_rows=256, keys_per_step=256)  # other chips, and the interpreter on CPU


def block_sizes(device_kind: str | None = None) -> TpuBlockSizes:
    """The sizes for `device_kind` (default: the first device's)."""
    kind = (device_kind if device_kind is not None else jax.devices()[0].device_kind).lower()
    return next((sizes for key, sizes in BLOCK_SIZES.items() if key in kind), DEFAULT)


def sublane_tile(dtype) -> int:
    """Rows of one (sublane, lane) register tile for `dtype`: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    return 32 // jnp.dtype(dtype).itemsize


def tokens_per_block_for(rows: int, group: int, dtype) -> int:
    """A power of two >= 1 with tokens x group close to `rows` (at least one token) and a multiple of the
    dtype's sublane tile. Decode blocks hold one real token each: they ask for rows = 1."""
    tile = sublane_tile(dtype)
    tokens = 1
    while tokens * group < rows:
        tokens *= 2
    while (tokens * group) % tile:
        tokens *= 2
    return tokens
