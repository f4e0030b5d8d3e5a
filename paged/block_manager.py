"""Host-side KV block bookkeeping: a free list, reference counts and the page table.

Block 0 is never handed out: it is the sink that padded tokens write to and padded page-table entries
point at, which keeps the device-side scatter and gather branch-free.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from paged.request import Request

SINK_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_blocks_per_seq: int):
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be at least 2 (one is the reserved sink), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.free_blocks: deque[int] = deque(range(1, num_blocks))
        self.ref_counts = np.zeros(num_blocks, np.int32)
        # [max_num_seqs, max_blocks_per_seq]: a running request owns one row while it holds blocks; rows are
        # updated only when a block is added or freed, so preparing a step copies rows instead of rebuilding.
        self.page_table = np.zeros((max_num_seqs, max_blocks_per_seq), np.int32)
        self.free_rows: list[int] = list(range(max_num_seqs - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Grows `request` to hold `num_tokens` tokens of K/V. All or nothing; False when blocks run out."""
        needed = self.blocks_for(num_tokens) - len(request.block_ids)
        if needed <= 0:
            return True
        if needed > len(self.free_blocks):
            return False
        if request.page_row is None:
            request.page_row = self.free_rows.pop()
        row = self.page_table[request.page_row]
        for _ in range(needed):
            block = self.free_blocks.popleft()
            self.ref_counts[block] += 1
            row[len(request.block_ids)] = block
            request.block_ids.append(block)
        return True

    def free(self, request: Request) -> None:
        """Releases every block of `request` (shared blocks stay until their last holder lets go)."""
        for block in request.block_ids:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        request.block_ids = []
        if request.page_row is not None:
            self.page_table[request.page_row] = SINK_BLOCK
            self.free_rows.append(request.page_row)
            request.page_row = None

    def slots(self, request: Request, start: int, stop: int) -> np.ndarray:
        """int32 [stop - start]: pool slots (block * block_size + offset) of token positions start..stop-1."""
        positions = np.arange(start, stop)
        blocks = self.page_table[request.page_row, positions // self.block_size]
        return (blocks * self.block_size + positions % self.block_size).astype(np.int32)
