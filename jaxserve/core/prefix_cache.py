"""Automatic prefix caching: KV blocks addressed by their content (host side, no JAX).

A full block's hash covers its parent block's hash and its own token ids (and ``extra``, for any
future input that changes its K/V), so equal hashes mean equal K/V for the whole prefix up to and
including that block. The ``BlockManager`` keeps one ``PrefixCache``: a table from hash to block id
for every block whose K/V are in the pool, and, among those, the blocks nobody holds any more in an
LRU list. Those stay cached and are reused by a later hit; one is evicted (its hash dropped, so it can
never serve stale K/V) only when a fresh block is needed and no never-cached block is free.

The scheduler asks for the longest cached prefix of a new request's full blocks (``BlockManager.
cached_prefix``); the engine registers blocks once their K/V are computed (``BlockManager.cache_blocks``,
right after the step that computes them is dispatched: later steps run after it on the device).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxserve.core.sequence import PLACEHOLDER_TOKEN, Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: list[int], extra: bytes = b"") -> BlockHash:
    """SHA-256 of (parent hash, token ids as int64, extra): collisions are not a practical concern."""
    digest = hashlib.sha256(parent or b"root")
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    digest.update(extra)
    return digest.digest()


def hash_full_blocks(seq: Sequence, block_size: int, num_tokens: int) -> int:
    """Extends ``seq.block_hashes`` to the full blocks within its first ``num_tokens`` tokens (each block is
    hashed once per sequence) and returns how many of them are hashed: it stops before a block holding a
    token still on the device."""
    hashes = seq.block_hashes
    num_full = min(num_tokens, seq.num_tokens) // block_size
    if len(hashes) < num_full:
        tokens = seq.all_token_ids
        for index in range(len(hashes), num_full):
            block = tokens[index * block_size : (index + 1) * block_size]
            if PLACEHOLDER_TOKEN in block:
                break
            hashes.append(hash_block(hashes[-1] if hashes else None, block))
    return min(len(hashes), num_full)


@dataclass(frozen=True)
class BlocksStored:
    """A run of consecutive blocks of one sequence that entered the cache: their hashes, the hash of the block before
    the first (None: the sequence's first block) and their tokens (KV cache events, `engine/kv_events.py`)."""

    block_hashes: list[BlockHash]
    parent: BlockHash | None
    token_ids: list[int]


@dataclass(frozen=True)
class BlocksRemoved:
    """Blocks whose hashes left the cache (evicted, or dropped by a reset)."""

    block_hashes: list[BlockHash]


@dataclass(frozen=True)
class AllBlocksCleared:
    """A reset left nothing cached."""


@dataclass
class PrefixCacheStats:
    """vLLM's counters, in tokens: prompt tokens looked up at admission, and those found cached."""

    queries: int = 0
    hits: int = 0


class PrefixCache:
    """(KV cache group, hash) -> block table, and the LRU lists of cached blocks that no sequence holds (evictable),
    one per kind of page (`kind_of` a block id; one kind unless the model's pages differ in shape). Each group
    caches its own blocks of a prefix (`config/kv_cache_groups.py`): one block id per group and hash."""

    def __init__(self, kind_of: Callable[[int], int] = lambda block_id: 0, num_kinds: int = 1) -> None:
        self.block_of: dict[tuple[int, BlockHash], int] = {}
        self.key_of: dict[int, tuple[int, BlockHash]] = {}
        self.kind_of = kind_of
        self.evictable: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_kinds)]  # oldest first

    @property
    def num_cached_blocks(self) -> int:
        return len(self.key_of)

    @property
    def num_evictable(self) -> int:
        return sum(len(blocks) for blocks in self.evictable)

    def num_evictable_of(self, kind: int) -> int:
        return len(self.evictable[kind])

    def cached_block(self, block_hash: BlockHash, group: int = 0) -> int | None:
        """The block of ``group`` that caches ``block_hash``, if any."""
        return self.block_of.get((group, block_hash))

    def longest_prefix(self, hashes: list[BlockHash], num_blocks: int, group: int = 0) -> list[int]:
        """Block ids of ``group``'s cached blocks of ``hashes[:num_blocks]``, from the first, up to the first miss."""
        blocks = []
        for block_hash in hashes[:num_blocks]:
            block_id = self.block_of.get((group, block_hash))
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def insert(self, block_id: int, block_hash: BlockHash, group: int = 0) -> bool:
        """Register a held block whose K/V are computed; whether it entered the cache. A block already cached, or
        content another block of its group already caches (two requests computed the same prefix at once),
        changes nothing."""
        if block_id in self.key_of or (group, block_hash) in self.block_of:
            return False
        self.block_of[group, block_hash] = block_id
        self.key_of[block_id] = (group, block_hash)
        return True

    def is_cached(self, block_id: int) -> bool:
        return block_id in self.key_of

    def release(self, block_id: int) -> None:
        """A cached block nobody holds any more: most recently used end of the LRU list."""
        self.evictable[self.kind_of(block_id)][block_id] = None

    def touch(self, block_id: int) -> None:
        """A hit on a block nobody held: it leaves the LRU list (no-op for a held block)."""
        self.evictable[self.kind_of(block_id)].pop(block_id, None)

    def evict(self, kind: int = 0) -> tuple[int, int, BlockHash]:
        """The least recently used evictable block of ``kind``, its hash dropped: a fresh block, the group it cached
        for and the hash it had."""
        block_id, _ = self.evictable[kind].popitem(last=False)
        group, block_hash = self.key_of.pop(block_id)
        del self.block_of[group, block_hash]
        return block_id, group, block_hash
