"""Host-side KV block bookkeeping: free queue, reference counts, prefix cache and the page table.

Block 0 is never handed out: it is the sink that padded tokens write to and padded page-table entries
point at, which keeps the device-side scatter and gather branch-free.

Prefix caching: a full block is keyed by its chain key (paged/prefix_keys.py), which names the whole prefix up
to and including that block. Blocks whose last holder lets go stay in the cache, in
the free queue in least-recently-used order, until allocation needs them; a hit takes a block back out.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from paged.prefix_keys import extend_chain
from paged.request import Request

SINK_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_blocks_per_seq: int,
                 enable_prefix_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be at least 2 (one is the reserved sink), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.enable_prefix_caching = enable_prefix_caching
        # Free blocks, oldest first; allocation takes from the front (evicting a cached block if needed).
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.ref_counts = np.zeros(num_blocks, np.int32)
        self.block_hash: dict[int, bytes] = {}  # block -> its chain key, for blocks in the cache
        self.cached: dict[bytes, int] = {}  # chain key -> block
        # [max_num_seqs, max_blocks_per_seq]: a running request owns one row while it holds blocks; rows are
        # updated only when a block is added or freed, so preparing a step copies rows instead of rebuilding.
        self.page_table = np.zeros((max_num_seqs, max_blocks_per_seq), np.int32)
        self.free_rows: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self.prefix_queries = 0  # full blocks looked up
        self.prefix_hits = 0  # full blocks found
        self.num_window_freed = 0  # blocks released because they fell out of every layer's window

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation -----------------------------------------------------------------------------------

    def _take_free_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        if block in self.block_hash:  # evict the least recently used cached block
            del self.cached[self.block_hash.pop(block)]
        self.ref_counts[block] = 1
        return block

    def _append_block(self, request: Request, block: int) -> None:
        if request.page_row is None:
            request.page_row = self.free_rows.pop()
        self.page_table[request.page_row, len(request.block_ids)] = block
        request.block_ids.append(block)

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Grows `request` to hold `num_tokens` tokens of K/V. All or nothing; False when blocks run out."""
        needed = self.blocks_for(num_tokens) - len(request.block_ids)
        if needed <= 0:
            return True
        if needed > len(self.free_queue):
            return False
        for _ in range(needed):
            self._append_block(request, self._take_free_block())
        return True

    def share(self, request: Request, blocks: list[int]) -> None:
        """Appends already-computed blocks to `request` (a prefix hit or a parallel-sampling fork)."""
        for block in blocks:
            if block == SINK_BLOCK:  # a position the source already released (out of the window)
                self._append_block(request, block)
                continue
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1
            self._append_block(request, block)

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Releases `request`'s blocks past those holding its first `num_tokens` tokens (allocated for
        proposals that verification rejected). They hold no computed tokens, so none is cached."""
        keep = self.blocks_for(num_tokens)
        while len(request.block_ids) > keep:
            self._release(request.block_ids.pop())
            self.page_table[request.page_row, len(request.block_ids)] = SINK_BLOCK

    def free(self, request: Request) -> None:
        """Releases every block of `request`; shared blocks stay until their last holder lets go.

        Blocks go back in reverse order, so a sequence's tail is evicted before the prefix others may share.
        """
        for block in reversed(request.block_ids):
            self._release(block)
        request.block_ids = []
        request.num_registered_blocks = 0
        if request.page_row is not None:
            self.page_table[request.page_row] = SINK_BLOCK
            self.free_rows.append(request.page_row)
            request.page_row = None

    def _release(self, block: int) -> None:
        if block == SINK_BLOCK:
            return
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_queue[block] = None
            if block not in self.block_hash:  # nothing worth keeping: reuse it first
                self.free_queue.move_to_end(block, last=False)

    def free_outside_window(self, request: Request, window: int) -> None:
        """Releases the leading blocks no future query of `request` can see, when every layer attends to at
        most the last `window` keys: the next query sits at position num_computed_tokens (before any proposals
        in flight) and sees keys from there - window + 1 on. Released positions point at the sink block, so
        positions and page-table columns stay aligned (kernels never read them unmasked)."""
        first_needed = request.num_computed_tokens - request.num_drafts - window + 1
        num_dead = min(max(first_needed, 0) // self.block_size, len(request.block_ids))
        for i in range(num_dead):
            block = request.block_ids[i]
            if block == SINK_BLOCK:
                continue
            self._release(block)
            request.block_ids[i] = SINK_BLOCK
            self.page_table[request.page_row, i] = SINK_BLOCK
            self.num_window_freed += 1

    # ---- prefix caching -------------------------------------------------------------------------------

    def _hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """The request's memoised chain keys, extended to cover at least `num_full_blocks` blocks."""
        return extend_chain(request.block_hashes, request.token_ids, self.block_size, num_full_blocks,
                            request.prefix_root)

    def num_cached_leading(self, hashes: list[bytes]) -> int:
        """How many of the leading chain keys (`prefix_chain`) the cache holds. A hint for routing: it reads
        one dict without the engine's thread (safe in CPython)."""
        for i, h in enumerate(hashes):
            if h not in self.cached:
                return i
        return len(hashes)

    def match_prefix(self, request: Request) -> int:
        """Shares the longest cached prefix of a request that holds no blocks; returns tokens covered.

        At least one token is always left to compute: the step needs it to produce logits. A request still
        missing prompt logprobs computes its whole prompt (as vLLM does): cached blocks hold no logits.
        """
        if not self.enable_prefix_caching or request.block_ids or request.missing_prompt_logprobs:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        hashes = self._hashes(request, max_blocks)
        for i in range(max_blocks):
            block = self.cached.get(hashes[i])
            if block is None:
                break
            hits.append(block)
        self.share(request, hits)
        return len(hits) * self.block_size

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the request's computed, full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        # Proposals still being verified (their step in flight) are not the request's tokens yet.
        num_full = min((request.num_computed_tokens - request.num_drafts) // self.block_size, len(request.block_ids))
        hashes = self._hashes(request, num_full)
        for i in range(request.num_registered_blocks, num_full):
            block, h = request.block_ids[i], hashes[i]
            if block == SINK_BLOCK or block in self.block_hash or h in self.cached:
                continue  # already cached, or the same content lives in another block
            self.block_hash[block] = h
            self.cached[h] = block
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def reset_prefix_cache(self) -> int:
        """Forgets every cached block (new weights, or a pool whose contents were released); the number
        forgotten. Blocks stay with whoever holds them."""
        count = len(self.cached)
        self.block_hash.clear()
        self.cached.clear()
        return count

    # ---- device addressing ----------------------------------------------------------------------------

    def slots(self, request: Request, start: int, stop: int) -> np.ndarray:
        """int32 [stop - start]: pool slots (block * block_size + offset) of token positions start..stop-1."""
        positions = np.arange(start, stop)
        blocks = self.page_table[request.page_row, positions // self.block_size]
        return (blocks * self.block_size + positions % self.block_size).astype(np.int32)

    def live_token_slots(self, requests: list[Request]) -> int:
        """Token slots holding computed K/V across `requests`, counting a shared block once."""
        filled: dict[int, int] = {}
        bs = self.block_size
        for request in requests:
            for i, block in enumerate(request.block_ids):
                if block == SINK_BLOCK:
                    continue
                n = min(bs, max(0, request.num_computed_tokens - i * bs))
                filled[block] = max(filled.get(block, 0), n)
        return sum(filled.values())
