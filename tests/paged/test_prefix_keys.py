"""Prefix-cache keys: sha256 chained over the parent key and the block's tokens, from a root covering the salt."""

from __future__ import annotations

import hashlib
import struct

import pytest

from paged.block_manager import BlockManager
from paged.prefix_keys import chain_key, prefix_chain, prefix_root
from paged.request import Request
from paged.sampling_params import SamplingParams


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def test_keys_follow_the_stated_derivation():
    # Written out with struct, independently of the numpy packing the module uses.
    root = _sha(b"paged.prefix-cache.v1")
    assert prefix_root() == root
    assert prefix_root("tenant-a") == _sha(b"paged.prefix-cache.v1\x00" + struct.pack("<I", 8) + b"tenant-a")
    assert prefix_root(rope_class="longrope:long") == _sha(b"paged.prefix-cache.v1\x01" + struct.pack("<I", 13)
                                                           + b"longrope:long")
    assert prefix_root("a\x01\x05\x00\x00\x00") != prefix_root("a", "\x05")
    first = _sha(root + struct.pack("<4i", 1, 2, 3, 4))
    second = _sha(first + struct.pack("<4i", 5, 6, 7, 150_000))
    assert chain_key(root, [1, 2, 3, 4]) == first
    assert prefix_chain([1, 2, 3, 4, 5, 6, 7, 150_000, 9], block_size=4, max_blocks=8) == [first, second]


def test_a_key_depends_on_every_token_its_parent_and_the_salt():
    tokens = list(range(16))
    base = prefix_chain(tokens, 4, 4)
    assert len(set(base)) == 4
    changed = list(tokens)
    changed[1] = 99  # only the first block differs: every later key differs too (the chain)
    assert all(a != b for a, b in zip(base, prefix_chain(changed, 4, 4)))
    assert all(a != b for a, b in zip(base, prefix_chain(tokens, 4, 4, cache_salt="x")))
    assert prefix_chain(tokens, 4, 4, cache_salt="x") == prefix_chain(tokens, 4, 4, cache_salt="x")
    # Token ids are not confused across byte boundaries: [256] is not [0, 1] and so on.
    assert chain_key(prefix_root(), [256, 0]) != chain_key(prefix_root(), [0, 1])


def _cached_request(bm, request_id, tokens, salt=None):
    request = Request(request_id, None, tokens, SamplingParams(), seed=0, detokenizer=None,
                      prefix_root=prefix_root(salt))
    hit = bm.match_prefix(request)
    assert bm.allocate(request, len(tokens))
    request.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(request)
    return request, hit


@pytest.mark.parametrize("salt_a, salt_b, shared", [(None, None, True), ("a", "a", True), (None, "a", False),
                                                     ("a", "b", False)])
def test_blocks_are_shared_only_under_the_same_salt(salt_a, salt_b, shared):
    bm = BlockManager(num_blocks=32, block_size=4, max_num_seqs=4, max_blocks_per_seq=8, enable_prefix_caching=True)
    tokens = list(range(100, 113))
    _cached_request(bm, "a", tokens, salt_a)
    _, hit = _cached_request(bm, "b", tokens, salt_b)
    assert hit == (12 if shared else 0)


def test_the_same_block_behind_another_prefix_is_not_a_hit():
    bm = BlockManager(num_blocks=32, block_size=4, max_num_seqs=4, max_blocks_per_seq=8, enable_prefix_caching=True)
    _cached_request(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    _, hit = _cached_request(bm, "b", [9, 9, 9, 9, 5, 6, 7, 8, 9])  # second block's tokens alike, parent not
    assert hit == 0
    _, hit = _cached_request(bm, "c", [1, 2, 3, 4, 0, 0, 0, 0, 9])  # the first block alone matches
    assert hit == 4


def test_the_engine_shares_a_prefix_only_within_a_salt(tiny_model_dir):
    from paged import LLM
    llm = LLM(tiny_model_dir, block_size=8, max_model_len=128, enable_prefix_caching=True, show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = list(range(5, 45))  # five full blocks; four can be hits (the last token is always computed)

    def cached(**extra):
        return llm.generate({"prompt_token_ids": prompt, **extra}, params, use_tqdm=False)[0].num_cached_tokens

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0
    assert cached(cache_salt="tenant-a") == 32
    assert cached() == 32
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        cached(cache_salt="")
