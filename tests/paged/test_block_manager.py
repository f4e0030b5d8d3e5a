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
