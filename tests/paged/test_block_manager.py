from __future__ import annotations

import numpy as np

from paged.block_manager import SINK_BLOCK, BlockManager
from paged.request import Request
from paged.sampling_params import SamplingParams


def _request(n):
    return Request(f"r{n}", None, list(range(n)), SamplingParams(), seed=0, detokenizer=None)


def test_allocate_grows_on_demand_and_free_returns_everything():
    bm = BlockManager(num_blocks=9, block_size=4, max_num_seqs=2, max_blocks_per_seq=4)
    a, b = _request(5), _request(3)
    assert bm.allocate(a, 5) and len(a.block_ids) == 2
    assert bm.allocate(a, 8) and len(a.block_ids) == 2  # still fits in two blocks
    assert bm.allocate(a, 9) and len(a.block_ids) == 3
    assert bm.allocate(b, 3)
    assert SINK_BLOCK not in a.block_ids + b.block_ids
    assert len(set(a.block_ids + b.block_ids)) == 4
    np.testing.assert_array_equal(bm.page_table[a.page_row, :3], a.block_ids)
    # slots follow the page table: token 4 is offset 0 of the second block
    assert bm.slots(a, 4, 5)[0] == a.block_ids[1] * 4
    assert bm.num_free_blocks == 4
    assert not bm.allocate(b, 4 * 6)  # needs 5 more blocks, 4 free: all or nothing
    assert len(b.block_ids) == 1 and bm.num_free_blocks == 4
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and not bm.ref_counts.any() and not bm.page_table.any()
    assert a.page_row is None and sorted(bm.free_rows) == [0, 1]


def test_blocks_behind_the_window_are_released_and_shared_ones_survive():
    bm = BlockManager(num_blocks=12, block_size=4, max_num_seqs=2, max_blocks_per_seq=6)
    a, b = _request(20), _request(20)
    assert bm.allocate(a, 20)
    original = list(a.block_ids)
    bm.share(b, original[:2])  # b shares a's first two blocks (like a parallel-sampling fork)
    a.num_computed_tokens = 14  # next query at 14 sees keys 9..14 with a window of 6: blocks 0 and 1 are dead
    bm.free_outside_window(a, window=6)
    assert a.block_ids[:2] == [SINK_BLOCK, SINK_BLOCK] and a.block_ids[2:] == original[2:]
    np.testing.assert_array_equal(bm.page_table[a.page_row, :2], SINK_BLOCK)
    assert bm.ref_counts[original[0]] == 1 and bm.num_free_blocks == 11 - 5  # b still holds them
    bm.free_outside_window(a, window=6)  # idempotent
    assert bm.num_window_freed == 2
    bm.free(b)
    assert bm.num_free_blocks == 11 - 3
    bm.free(a)  # skips the sink placeholders
    assert bm.num_free_blocks == 11 and not bm.ref_counts.any()
