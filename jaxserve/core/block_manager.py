"""KV block allocator (host side, numpy only, no JAX).

The KV cache on the device is one pool of ``num_blocks`` pages of ``block_size`` token slots per
layer. This module only does the bookkeeping: which pages are free, how many sequences share each
page (reference counts, for n > 1 and beam search), and each sequence's ``block_table``. The
``Scheduler`` asks ``can_allocate`` / ``allocate`` before it schedules a chunk or a decode token, and
the step's inputs carry the rows' block tables as padded int32 arrays (``runner/input_batch.py``).

Token ``i`` of a sequence lives in slot ``i % block_size`` of page ``block_table[i // block_size]``.

With prefix caching (``enable_prefix_caching``) full computed blocks are also addressed by content
(``prefix_cache.py``): a block whose count drops to zero stays cached (evictable) instead of free, a new
request starts on the longest cached prefix of its blocks (``cached_prefix`` / ``allocate_prefix``), and
a cached block is evicted only when a fresh block is needed and no never-cached block is free.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

from jaxserve.core.prefix_cache import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    PrefixCache,
    PrefixCacheStats,
    hash_full_blocks,
)
from jaxserve.core.sequence import Sequence
from jaxserve.math_utils import cdiv


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # never cached (or evicted): fresh first
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        self.prefix_cache_stats = PrefixCacheStats()  # stays zero without prefix caching
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst), see take_pending_copies
        # blocks that entered and left the prefix cache since `take_cache_events` (None: not recorded)
        self.cache_events: list[BlocksStored | BlocksRemoved | AllBlocksCleared] | None = None

    # -- pool state ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds: free ones and cached ones that may be evicted."""
        return len(self.free_block_ids) + self._num_evictable

    @property
    def _num_evictable(self) -> int:
        return self.prefix_cache.num_evictable if self.prefix_cache is not None else 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- allocation ---------------------------------------------------------------------------------

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``seq`` still needs to write ``num_new_tokens`` more tokens: new ones to hold
        ``num_computed_tokens + num_new_tokens`` tokens, plus a private copy of every block it will
        write that a fork shares (copy-on-write)."""
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table)) + len(self._shared_write_blocks(seq, num_new_tokens))

    def _shared_write_blocks(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Indices in ``seq.block_table`` of the blocks the next tokens go to that another sequence holds."""
        if num_new_tokens < 1:
            return []
        first = seq.num_computed_tokens // self.block_size
        last = min((seq.num_computed_tokens + num_new_tokens - 1) // self.block_size, len(seq.block_table) - 1)
        return [i for i in range(first, last + 1) if self.ref_counts[seq.block_table[i]] > 1]

    def can_allocate(self, seq: Sequence, num_new_tokens: int, *, reserve: int = 0) -> bool:
        """Whether ``allocate`` would succeed and still leave ``reserve`` blocks free."""
        return self.num_new_blocks(seq, num_new_tokens) + reserve <= self.num_free_blocks

    def can_allocate_with_prefix(self, seq: Sequence, prefix: list[int], *, reserve: int = 0) -> bool:
        """Whether a new ``seq`` fits whole on the cached blocks ``prefix`` plus fresh ones, leaving ``reserve``
        free. A hit on a block nobody holds takes it out of the free count too."""
        num_fresh = self.num_blocks_for(seq.num_tokens) - len(prefix)
        num_revived = sum(1 for block_id in prefix if self.ref_counts[block_id] == 0)
        return num_fresh + num_revived + reserve <= self.num_free_blocks

    def num_allocatable_tokens(self, seq: Sequence) -> int:
        """The most new tokens ``seq`` could get right now (its table's slack plus every free block)."""
        capacity = (len(seq.block_table) + self.num_free_blocks) * self.block_size
        return max(0, capacity - seq.num_computed_tokens)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_computed_tokens + num_new_tokens`` tokens, and give
        ``seq`` a private copy of every shared block those tokens go to (queued in ``pending_copies``)."""
        n = self.num_new_blocks(seq, num_new_tokens)
        if n > self.num_free_blocks:
            raise RuntimeError(
                f"seq {seq.seq_id}: needs {n} new KV blocks, only {self.num_free_blocks} free "
                "(call can_allocate first)"
            )
        for index in self._shared_write_blocks(seq, num_new_tokens):
            self.pending_copies.append(self._copy_block(seq, index))
        n = max(0, self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))
        for _ in range(n):
            seq.block_table.append(self._take_fresh_block())

    def _take_fresh_block(self) -> int:
        """A block for new K/V, held once: a never-cached free block, else the least recently used cached one."""
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            block_id, block_hash = self.prefix_cache.evict()
            if self.cache_events is not None:
                self.cache_events.append(BlocksRemoved([block_hash]))
        self.ref_counts[block_id] = 1
        return block_id

    # -- prefix caching -----------------------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        """Drops every cached block nobody holds (their hashes leave the cache, the blocks become free); blocks that
        running sequences hold stay cached. The number dropped. Recorded as one `AllBlocksCleared` when nothing
        stays cached (vLLM's event for a reset), else as the dropped blocks' `BlocksRemoved`."""
        if self.prefix_cache is None:
            return 0
        dropped = []
        while self.prefix_cache.num_evictable:
            block_id, block_hash = self.prefix_cache.evict()
            self.free_block_ids.append(block_id)
            dropped.append(block_hash)
        if self.cache_events is not None and dropped:
            cleared = self.prefix_cache.num_cached_blocks == 0
            self.cache_events.append(AllBlocksCleared() if cleared else BlocksRemoved(dropped))
        return len(dropped)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks of the longest prefix of ``seq``'s full blocks, never its last token's block
        (at least one token is computed, for its logits); empty without prefix caching."""
        if self.prefix_cache is None or not seq.use_prefix_cache:
            return []
        num_hashed = hash_full_blocks(seq, self.block_size, seq.num_tokens - 1)
        return self.prefix_cache.longest_prefix(seq.block_hashes, num_hashed)

    def allocate_prefix(self, seq: Sequence, prefix: list[int]) -> None:
        """Start a new ``seq`` on the cached blocks ``prefix``: they join its table and count as computed.
        Records the lookup (vLLM's prefix_cache_queries / hits, in tokens) and the request's cached tokens."""
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"seq {seq.seq_id}: a cached prefix is taken by a sequence without blocks")
        for block_id in prefix:
            self.prefix_cache.touch(block_id)
            self.ref_counts[block_id] += 1
        seq.block_table = list(prefix)
        seq.num_computed_tokens = len(prefix) * self.block_size
        seq.num_registered_blocks = len(prefix)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed_tokens
        if self.prefix_cache is not None and seq.use_prefix_cache:
            self.prefix_cache_stats.queries += seq.num_tokens
            self.prefix_cache_stats.hits += seq.num_computed_tokens

    def cache_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s full blocks whose K/V are computed (or in a dispatched step) in the cache."""
        if self.prefix_cache is None:
            return
        num_hashed = hash_full_blocks(seq, self.block_size, seq.num_computed_tokens)
        stored = [index for index in range(seq.num_registered_blocks, num_hashed)
                  if self.prefix_cache.insert(seq.block_table[index], seq.block_hashes[index])]
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_hashed)
        if self.cache_events is not None and stored:
            self._record_stored(seq, stored)

    def _record_stored(self, seq: Sequence, indices: list[int]) -> None:
        """One `BlocksStored` per run of consecutive blocks of ``seq`` that entered the cache (vLLM's grouping)."""
        tokens, size = seq.all_token_ids, self.block_size
        runs = [[indices[0]]]
        for index in indices[1:]:
            if index == runs[-1][-1] + 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            first, end = run[0], run[-1] + 1
            parent = seq.block_hashes[first - 1] if first else None
            tokens_of_run = tokens[first * size : end * size]
            self.cache_events.append(BlocksStored(seq.block_hashes[first:end], parent, tokens_of_run))

    def take_cache_events(self) -> list[BlocksStored | BlocksRemoved | AllBlocksCleared]:
        """The cache events recorded since the last call (none unless ``cache_events`` was set to a list)."""
        if self.cache_events is None:
            return []
        events, self.cache_events = self.cache_events, []
        return events

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks nobody else holds go back to the free list."""
        self._decref(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share every block of ``parent`` (reference count + 1 each)."""
        if child.block_table:
            raise ValueError(f"seq {child.seq_id}: cannot fork into a sequence that already has blocks")
        self._check_owned(parent.block_table)
        child.block_table = list(parent.block_table)
        np.add.at(self.ref_counts, child.block_table, 1)

    def copy_on_write(self, seq: Sequence) -> tuple[int, int] | None:
        """Before writing into a block shared with a fork: give ``seq`` a private copy of it.

        Checks the block that will receive token ``num_computed_tokens``. Returns ``(src, dst)``
        block ids for the model runner to copy on the device, or None when nothing must be copied.
        ``allocate`` does this itself for every block it is about to write.
        """
        index = seq.num_computed_tokens // self.block_size
        if index >= len(seq.block_table) or self.ref_counts[seq.block_table[index]] == 1:
            return None
        if not self.num_free_blocks:
            raise RuntimeError(f"seq {seq.seq_id}: no free KV block for copy-on-write")
        return self._copy_block(seq, index)

    def _copy_block(self, seq: Sequence, index: int) -> tuple[int, int]:
        src = seq.block_table[index]
        dst = self._take_fresh_block()
        self.ref_counts[src] -= 1
        seq.block_table[index] = dst
        return src, dst

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies ``allocate`` queued, for the device to apply before the next step.

        A destination freed since (its sequence was preempted) is dropped; if it was handed out again to
        another copy, only that later copy is kept."""
        latest = {dst: src for src, dst in self.pending_copies}
        self.pending_copies = []
        return [(src, dst) for dst, src in latest.items() if self.ref_counts[dst] > 0]

    # -- measurement --------------------------------------------------------------------------------

    def kv_waste(self, seqs: Iterable[Sequence]) -> float:
        """(allocated slots - used slots) / allocated slots over ``seqs``; 0.0 when nothing is allocated.

        Used slots are the tokens whose K/V are in the cache (``num_computed_tokens``). A block shared
        by several sequences counts once per sequence holding it.
        """
        allocated = used = 0
        for seq in seqs:
            capacity = len(seq.block_table) * self.block_size
            allocated += capacity
            used += min(seq.num_computed_tokens, capacity)
        return (allocated - used) / allocated if allocated else 0.0

    # -- internals ----------------------------------------------------------------------------------

    def _check_owned(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"unknown KV block {block_id} (pool has {self.num_blocks} blocks)")
        counts = np.bincount(np.asarray(block_ids, dtype=np.int64), minlength=self.num_blocks)
        over = np.flatnonzero(counts > self.ref_counts)
        if over.size:
            raise ValueError(f"double free of KV block {int(over[0])}: it is not allocated that many times")

    def _decref(self, block_ids: list[int]) -> None:
        """With prefix caching, last blocks first: a cached prefix's tail is evicted before its head (vLLM's order)."""
        self._check_owned(block_ids)  # validate everything first: a failed free changes nothing
        for block_id in reversed(block_ids) if self.prefix_cache is not None else block_ids:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] > 0:
                continue
            if self.prefix_cache is not None and self.prefix_cache.is_cached(block_id):
                self.prefix_cache.release(block_id)
            else:
                self.free_block_ids.append(block_id)


