"""KV block allocator (host side, numpy only, no JAX).

The KV cache on the device is one pool of ``num_blocks`` pages of ``block_size`` token slots per
pool row. This module only does the bookkeeping: which pages are free, how many sequences share each
page (reference counts, for n > 1 and beam search), and each sequence's block tables, one per KV cache group
(`config/kv_cache_groups.py`; one group unless the model mixes sliding-window and full-attention layers). The
``Scheduler`` asks ``can_allocate`` / ``allocate`` before it schedules a chunk or a decode token, and
the step's inputs carry the rows' block tables as padded int32 arrays (``runner/input_batch.py``).

Token ``i`` of a sequence lives in slot ``i % block_size`` of page ``table[i // block_size]`` of each group's
table. A sliding-window group gives back the blocks no future query of the sequence reaches
(``release_out_of_window``, `kv_cache_groups.first_kept_token`): their entries become ``NULL_BLOCK``, which
the step reads as block 0, masked out by the window.

With prefix caching (``enable_prefix_caching``) full computed blocks are also addressed by content
(``prefix_cache.py``), per group: a block whose count drops to zero stays cached (evictable) instead of free, a
new request starts on the longest cached prefix of its blocks (``cached_prefix`` / ``allocate_prefix``), and
a cached block is evicted only when a fresh block is needed and no never-cached block is free. A prefix hits
where every full group caches all its blocks and every sliding group the blocks its window reaches (vLLM's rule).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable

import numpy as np

from jaxserve.config.kv_cache_groups import NULL_BLOCK, blocks_per_request, first_block_ids, first_kept_token
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

CachedPrefix = list[list[int]]  # per KV cache group, the blocks of a cached prefix (NULL_BLOCK: out of a window)


class BlockManager:
    """``group_kinds``: per group, the kind of page its layers keep (Gemma 4's pages of two shapes); ``kind_blocks``:
    the block ids of each kind (`KVCacheLayout.blocks_of_kinds`), kind k's after kind k - 1's, each kind with its own
    free list. One kind by default: every id in one free list."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False,
                 group_windows: tuple[int | None, ...] = (None,), group_kinds: tuple[int, ...] | None = None,
                 kind_blocks: tuple[int, ...] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not group_windows:
            raise ValueError("a block manager needs at least one KV cache group")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.group_windows = tuple(group_windows)  # per KV cache group: its sliding window (None: full attention)
        self.group_kinds = tuple(group_kinds) if group_kinds is not None else (0,) * len(self.group_windows)
        self.kind_blocks = tuple(kind_blocks) if kind_blocks is not None else (num_blocks,)
        _check_kinds(self.group_windows, self.group_kinds, self.kind_blocks, num_blocks)
        self.kind_offsets = first_block_ids(self.kind_blocks)
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        # per kind, never cached (or evicted) blocks: fresh first
        kinds = zip(self.kind_offsets, self.kind_blocks, strict=True)
        self.free_by_kind: list[deque[int]] = [deque(range(first, first + count)) for first, count in kinds]
        self.prefix_cache = PrefixCache(self.kind_of, self.num_kinds) if enable_prefix_caching else None
        self.prefix_cache_stats = PrefixCacheStats()  # stays zero without prefix caching
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst), see take_pending_copies
        # blocks that entered and left the prefix cache since `take_cache_events` (None: not recorded)
        self.cache_events: list[BlocksStored | BlocksRemoved | AllBlocksCleared] | None = None

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_kinds(self) -> int:
        return len(self.kind_blocks)

    @property
    def free_block_ids(self) -> list[int]:
        """The never-cached (or evicted) free blocks, each kind's in the order they are handed out."""
        return [block_id for free in self.free_by_kind for block_id in free]

    def kind_of(self, block_id: int) -> int:
        """The kind of page ``block_id`` is."""
        return bisect.bisect_right(self.kind_offsets, block_id) - 1

    @property
    def has_sliding_groups(self) -> bool:
        return any(window is not None for window in self.group_windows)

    def tables(self, seq: Sequence) -> list[list[int]]:
        """``seq``'s block tables, one per group (a sequence without blocks gets empty ones)."""
        if len(seq.block_tables) != self.num_groups:
            if any(seq.block_tables):
                raise ValueError(f"seq {seq.seq_id}: {len(seq.block_tables)} block tables, the pool has "
                                 f"{self.num_groups} KV cache groups")
            seq.block_tables = [[] for _ in self.group_windows]
        return seq.block_tables

    # -- pool state ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds: free ones and cached ones that may be evicted (of every kind)."""
        return sum(self.num_free_of(kind) for kind in range(self.num_kinds))

    def num_free_of(self, kind: int) -> int:
        """Blocks of ``kind`` nobody holds."""
        evictable = self.prefix_cache.num_evictable_of(kind) if self.prefix_cache is not None else 0
        return len(self.free_by_kind[kind]) + evictable

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Entries of each group's table for ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    # -- allocation ---------------------------------------------------------------------------------

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int, num_sliding_tokens: int | None = None) -> int:
        """Blocks ``seq`` still needs, over all groups, to write ``num_new_tokens`` more tokens: new ones to hold
        ``num_computed_tokens + num_new_tokens`` tokens (``num_sliding_tokens`` of them in sliding groups, see
        `allocate`), plus a private copy of every block it will write that a fork shares (copy-on-write)."""
        return sum(self.new_blocks_by_kind(seq, num_new_tokens, num_sliding_tokens))

    def new_blocks_by_kind(self, seq: Sequence, num_new_tokens: int,
                           num_sliding_tokens: int | None = None) -> list[int]:
        """`num_new_blocks` per kind of page."""
        lengths = self._table_lengths(seq, num_new_tokens, num_sliding_tokens)
        needed = [0] * self.num_kinds
        for table, length, kind in zip(self.tables(seq), lengths, self.group_kinds, strict=True):
            needed[kind] += max(0, length - len(table)) + len(self._shared_write_blocks(table, seq, num_new_tokens))
        return needed

    def _fit(self, needed: list[int], reserve: int | list[int]) -> bool:
        """Whether every kind has ``needed`` blocks free beside ``reserve`` (a count per kind, or one for each)."""
        reserve = [reserve] * self.num_kinds if isinstance(reserve, int) else reserve
        return all(need + kept <= self.num_free_of(kind)
                   for kind, (need, kept) in enumerate(zip(needed, reserve, strict=True)))

    def _table_lengths(self, seq: Sequence, num_new_tokens: int, num_sliding_tokens: int | None) -> list[int]:
        """Per group, the entries ``seq``'s table needs for ``num_new_tokens`` more tokens."""
        full = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        if num_sliding_tokens is None:
            return [full] * self.num_groups
        sliding = self.num_blocks_for(seq.num_computed_tokens + min(num_new_tokens, num_sliding_tokens))
        return [full if window is None else sliding for window in self.group_windows]

    def _shared_write_blocks(self, table: list[int], seq: Sequence, num_new_tokens: int) -> list[int]:
        """Indices in ``table`` (one of ``seq``'s) of the blocks the next tokens go to that another sequence holds."""
        if num_new_tokens < 1:
            return []
        first = seq.num_computed_tokens // self.block_size
        last = min((seq.num_computed_tokens + num_new_tokens - 1) // self.block_size, len(table) - 1)
        return [i for i in range(first, last + 1) if table[i] != NULL_BLOCK and self.ref_counts[table[i]] > 1]

    def can_allocate(self, seq: Sequence, num_new_tokens: int, *, reserve: int | list[int] = 0) -> bool:
        """Whether ``allocate`` would succeed and still leave ``reserve`` blocks free (per kind, or in each)."""
        return self._fit(self.new_blocks_by_kind(seq, num_new_tokens), reserve)

    def can_allocate_with_prefix(self, seq: Sequence, prefix: CachedPrefix, *, reserve: int | list[int] = 0,
                                 max_chunk_tokens: int | None = None) -> bool:
        """Whether a new ``seq`` fits whole on the cached blocks ``prefix`` plus fresh ones, leaving ``reserve``
        free: every block of its tokens in a full group, and in a sliding group the most it holds at once when its
        prompt goes in chunks of at most ``max_chunk_tokens`` (None: in one). A hit on a block nobody holds takes it
        out of the free count too."""
        needed, chunk = [0] * self.num_kinds, seq.num_tokens if max_chunk_tokens is None else max_chunk_tokens
        for table, window, kind in zip(prefix, self.group_windows, self.group_kinds, strict=True):
            peak = blocks_per_request(window, seq.num_tokens, self.block_size, chunk)
            needed[kind] += max(0, peak - sum(block_id != NULL_BLOCK for block_id in table))
            needed[kind] += sum(1 for block_id in table if block_id != NULL_BLOCK and self.ref_counts[block_id] == 0)
        return self._fit(needed, reserve)

    def allocate(self, seq: Sequence, num_new_tokens: int, num_sliding_tokens: int | None = None) -> None:
        """Grow ``seq``'s tables to hold ``num_computed_tokens + num_new_tokens`` tokens (after giving back what its
        sliding groups no longer reach), and give ``seq`` a private copy of every shared block those tokens go to
        (queued in ``pending_copies``). ``num_sliding_tokens``: sliding groups get blocks for only that many of the
        new tokens (a prompt admitted whole but computed in chunks: its first chunk's), since they give blocks back
        as the prompt goes on."""
        self.release_out_of_window(seq)
        needed = self.new_blocks_by_kind(seq, num_new_tokens, num_sliding_tokens)
        if not self._fit(needed, 0):
            free = [self.num_free_of(kind) for kind in range(self.num_kinds)]
            per_kind = f" (per kind of page: needs {needed}, free {free})" if self.num_kinds > 1 else ""
            raise RuntimeError(f"seq {seq.seq_id}: needs {sum(needed)} new KV blocks, only {sum(free)} free{per_kind} "
                               "(call can_allocate first)")
        lengths = self._table_lengths(seq, num_new_tokens, num_sliding_tokens)
        for table, length, kind in zip(self.tables(seq), lengths, self.group_kinds, strict=True):
            for index in self._shared_write_blocks(table, seq, num_new_tokens):
                self.pending_copies.append(self._copy_block(table, index, kind))
            table.extend(self._take_fresh_block(kind) for _ in range(length - len(table)))

    def release_out_of_window(self, seq: Sequence) -> int:
        """Gives back the blocks of ``seq``'s sliding groups that no future query reaches (their entries become
        NULL_BLOCK); the number of entries dropped. The engine calls it as sequences advance (the scheduler, every
        step); blocks a fork shares stay with the fork."""
        if not self.has_sliding_groups:
            return 0
        dropped = []
        for window, table in zip(self.group_windows, self.tables(seq), strict=True):
            if window is None:
                continue
            index = min(first_kept_token(window, seq.num_computed_tokens) // self.block_size,
                        len(table)) - 1
            while index >= 0 and table[index] != NULL_BLOCK:
                dropped.append(table[index])
                table[index] = NULL_BLOCK
                index -= 1
        self._decref(dropped)
        return len(dropped)

    def _take_fresh_block(self, kind: int) -> int:
        """A block of ``kind`` for new K/V, held once: a never-cached free block, else the least recently used cached
        one."""
        if self.free_by_kind[kind]:
            block_id = self.free_by_kind[kind].popleft()
        else:
            block_id, group, block_hash = self.prefix_cache.evict(kind)
            if self.cache_events is not None and group == 0:
                self.cache_events.append(BlocksRemoved([block_hash]))
        self.ref_counts[block_id] = 1
        return block_id

    # -- prefix caching -----------------------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        """Drops every cached block nobody holds (their hashes leave the cache, the blocks become free); blocks that
        running sequences hold stay cached. The number dropped. Recorded as one `AllBlocksCleared` when nothing
        stays cached (vLLM's event for a reset), else as the dropped blocks' `BlocksRemoved` (the first group's:
        the events name a prefix by its blocks' hashes, which every group shares)."""
        if self.prefix_cache is None:
            return 0
        dropped, dropped_hashes = 0, []
        for kind in range(self.num_kinds):
            while self.prefix_cache.num_evictable_of(kind):
                block_id, group, block_hash = self.prefix_cache.evict(kind)
                self.free_by_kind[kind].append(block_id)
                dropped += 1
                if group == 0:
                    dropped_hashes.append(block_hash)
        if self.cache_events is not None and dropped:
            cleared = self.prefix_cache.num_cached_blocks == 0
            self.cache_events.append(AllBlocksCleared() if cleared else BlocksRemoved(dropped_hashes))
        return dropped

    def cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """Per group, the cached blocks of the longest prefix of ``seq``'s full blocks that every group can serve,
        never its last token's block (at least one token is computed, for its logits); empty tables without
        prefix caching. A full group needs all the prefix's blocks, a sliding group those its window reaches
        from the prefix's end (NULL_BLOCK before them)."""
        if self.prefix_cache is None or not seq.use_prefix_cache:
            return [[] for _ in self.group_windows]
        num_hashed = hash_full_blocks(seq, self.block_size, seq.num_tokens - 1)
        hashes = seq.block_hashes[:num_hashed]
        length = num_hashed
        for group, window in enumerate(self.group_windows):
            if window is None:
                length = len(self.prefix_cache.longest_prefix(hashes, length, group))
        shorter = True
        while shorter:  # a full group's hit stays a hit when shortened; a sliding group's may not
            shorter = False
            for group, window in enumerate(self.group_windows):
                reach = length if window is None else self._sliding_hit(hashes, length, group, window)
                shorter, length = shorter or reach < length, min(length, reach)
        return [self._prefix_table(hashes[:length], group, window)
                for group, window in enumerate(self.group_windows)]

    def _sliding_hit(self, hashes: list[bytes], length: int, group: int, window: int) -> int:
        """The longest prefix of at most ``length`` blocks whose last blocks, those a sliding ``group`` keeps at its
        end (`first_kept_token`), that group caches."""
        run = 0  # cached blocks of the group ending at the current one
        runs = []
        for block_hash in hashes[:length]:
            run = run + 1 if self.prefix_cache.cached_block(block_hash, group) is not None else 0
            runs.append(run)
        for end in range(length, 0, -1):
            first = first_kept_token(window, end * self.block_size) // self.block_size
            if runs[end - 1] >= end - first:
                return end
        return 0

    def _prefix_table(self, hashes: list[bytes], group: int, window: int | None) -> list[int]:
        first = 0 if window is None else first_kept_token(window, len(hashes) * self.block_size) // self.block_size
        return [NULL_BLOCK if index < first else self.prefix_cache.cached_block(block_hash, group)
                for index, block_hash in enumerate(hashes)]

    def allocate_prefix(self, seq: Sequence, prefix: CachedPrefix) -> None:
        """Start a new ``seq`` on the cached blocks ``prefix``: they join its tables and count as computed.
        Records the lookup (vLLM's prefix_cache_queries / hits, in tokens) and the request's cached tokens."""
        if any(self.tables(seq)) or seq.num_computed_tokens:
            raise ValueError(f"seq {seq.seq_id}: a cached prefix is taken by a sequence without blocks")
        if len(prefix) != self.num_groups:
            raise ValueError(f"a cached prefix of {len(prefix)} groups, the pool has {self.num_groups}")
        for block_id in (block_id for table in prefix for block_id in table if block_id != NULL_BLOCK):
            self.prefix_cache.touch(block_id)
            self.ref_counts[block_id] += 1
        seq.block_tables = [list(table) for table in prefix]
        seq.num_computed_tokens = len(prefix[0]) * self.block_size
        seq.num_registered_blocks = len(prefix[0])
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed_tokens
        if self.prefix_cache is not None and seq.use_prefix_cache:
            self.prefix_cache_stats.queries += seq.num_tokens
            self.prefix_cache_stats.hits += seq.num_computed_tokens

    def cache_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s full blocks whose K/V are computed (or in a dispatched step) in the cache, in every
        group that still holds them."""
        if self.prefix_cache is None:
            return
        num_hashed = hash_full_blocks(seq, self.block_size, seq.num_computed_tokens)
        first = seq.num_registered_blocks
        for group, table in enumerate(self.tables(seq)):
            stored = [index for index in range(first, num_hashed) if table[index] != NULL_BLOCK
                      and self.prefix_cache.insert(table[index], seq.block_hashes[index], group)]
            if group == 0 and self.cache_events is not None and stored:
                self._record_stored(seq, stored)
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_hashed)

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
        self._decref([block_id for table in self.tables(seq) for block_id in table])
        seq.block_tables = [[] for _ in self.group_windows]
        seq.num_registered_blocks = 0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share every block of ``parent`` (reference count + 1 each)."""
        if any(child.block_tables):
            raise ValueError(f"seq {child.seq_id}: cannot fork into a sequence that already has blocks")
        tables = self.tables(parent)
        held = [block_id for table in tables for block_id in table if block_id != NULL_BLOCK]
        self._check_owned(held)
        child.block_tables = [list(table) for table in tables]
        np.add.at(self.ref_counts, held, 1)

    def copy_on_write(self, seq: Sequence) -> list[tuple[int, int]]:
        """Before writing into a block shared with a fork: give ``seq`` a private copy of it in every group.

        Checks the blocks that will receive token ``num_computed_tokens``. Returns the ``(src, dst)`` block ids
        for the model runner to copy on the device (none when nothing must be copied). ``allocate`` does this
        itself for every block it is about to write.
        """
        copies = []
        for table, kind in zip(self.tables(seq), self.group_kinds, strict=True):
            for index in self._shared_write_blocks(table, seq, 1):
                if not self.num_free_of(kind):
                    raise RuntimeError(f"seq {seq.seq_id}: no free KV block for copy-on-write")
                copies.append(self._copy_block(table, index, kind))
        return copies

    def _copy_block(self, table: list[int], index: int, kind: int) -> tuple[int, int]:
        src = table[index]
        dst = self._take_fresh_block(kind)
        self.ref_counts[src] -= 1
        table[index] = dst
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

        Used slots are the tokens whose K/V are in the cache (``num_computed_tokens``) in the blocks held. A block
        shared by several sequences counts once per sequence holding it.
        """
        allocated = used = 0
        size = self.block_size
        for seq in seqs:
            for table in self.tables(seq):
                held = [index for index, block_id in enumerate(table) if block_id != NULL_BLOCK]
                allocated += len(held) * size
                used += sum(min(size, max(0, seq.num_computed_tokens - index * size)) for index in held)
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
        """With prefix caching, last blocks first: a cached prefix's tail is evicted before its head (vLLM's order).
        NULL_BLOCK entries are skipped."""
        block_ids = [block_id for block_id in block_ids if block_id != NULL_BLOCK]
        self._check_owned(block_ids)  # validate everything first: a failed free changes nothing
        for block_id in reversed(block_ids) if self.prefix_cache is not None else block_ids:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] > 0:
                continue
            if self.prefix_cache is not None and self.prefix_cache.is_cached(block_id):
                self.prefix_cache.release(block_id)
            else:
                self.free_by_kind[self.kind_of(block_id)].append(block_id)


def _check_kinds(group_windows: tuple, group_kinds: tuple[int, ...], kind_blocks: tuple[int, ...],
                 num_blocks: int) -> None:
    if len(group_kinds) != len(group_windows):
        raise ValueError(f"{len(group_kinds)} group kinds for {len(group_windows)} KV cache groups")
    if not kind_blocks or min(kind_blocks) < 1 or sum(kind_blocks) != num_blocks:
        raise ValueError(f"kind_blocks {kind_blocks} must be positive and add up to num_blocks ({num_blocks})")
    if any(not 0 <= kind < len(kind_blocks) for kind in group_kinds):
        raise ValueError(f"group kinds {group_kinds}: the pool has {len(kind_blocks)} kinds")
