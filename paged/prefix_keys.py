"""Prefix-cache keys: each full block of K/V is keyed by sha256 over its predecessor's key and its own token ids.

The chain starts from a root that covers whatever else changes the K/V (today a request's cache salt), so a key
names the whole prefix up to that block and nothing else can reach it. A cryptographic hash because keys are
shared across requests and tenants: a crafted prompt must not collide with another's prefix and read its K/V
(Python's built-in `hash()` of a tuple of ints is predictable, so collisions can be searched for).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_ROOT_DOMAIN = b"paged.prefix-cache.v1"


def prefix_root(cache_salt: str | None = None, rope_class: str | None = None, lora_name: str | None = None
                ) -> bytes:
    """The chain's root key: sha256 of a domain tag followed by each extra that is given, as one kind byte
    (0: the cache salt, 1: the rope class, 2: the LoRA adapter), its UTF-8 length (4 bytes, little-endian) and
    its UTF-8 bytes. Requests with different salts share no block (vLLM's `cache_salt`), nor do prompts whose
    rotary frequencies differ (`rope_class`, RopeConfig.length_class) or that run with different adapters
    (whose K/V differ); the lengths keep one extra from posing as another."""
    data = _ROOT_DOMAIN
    for kind, extra in ((0, cache_salt), (1, rope_class), (2, lora_name)):
        if extra is not None:
            raw = extra.encode("utf-8")
            data += bytes([kind]) + len(raw).to_bytes(4, "little") + raw
    return hashlib.sha256(data).digest()


DEFAULT_ROOT = prefix_root()


def chain_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """sha256(parent key (32 bytes) || token ids as little-endian int32): one full block's key."""
    return hashlib.sha256(parent + np.asarray(token_ids, "<i4").tobytes()).digest()


def extend_chain(keys: list[bytes], token_ids, block_size: int, num_blocks: int, root: bytes) -> list[bytes]:
    """Appends to `keys` (the chain of `token_ids`' first blocks from `root`) until it covers `num_blocks`."""
    while len(keys) < num_blocks:
        i = len(keys)
        keys.append(chain_key(keys[-1] if keys else root, token_ids[i * block_size:(i + 1) * block_size]))
    return keys


def prefix_chain(token_ids, block_size: int, max_blocks: int, cache_salt: str | None = None) -> list[bytes]:
    """The chain keys of the first full blocks of `token_ids` (at most `max_blocks`)."""
    return extend_chain([], token_ids, block_size, min(len(token_ids) // block_size, max_blocks),
                        prefix_root(cache_salt))
