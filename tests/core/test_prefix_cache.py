"""Prefix caching on the host: content hashes, the hash table, the LRU of evictable blocks, the block
manager's accounting with cached blocks, and the scheduler starting a prefill after a cached prefix."""

import numpy as np
import pytest

from jaxserve.core.block_manager import BlockManager
from jaxserve.core.buckets import BucketGrid
from jaxserve.core.prefix_cache import AllBlocksCleared, BlocksRemoved, BlocksStored, hash_block, hash_full_blocks
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sequence import PLACEHOLDER_TOKEN, Sequence, SequenceStatus
from tests.core.test_scheduler import SPEC, advance

BS = 4


def seq_of(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, tokens, arrival_time=0.0)


def computed(bm: BlockManager, tokens: list[int], request_id: str = "r") -> Sequence:
    """A sequence whose whole prompt went through a step: blocks allocated, computed, offered to the cache."""
    seq = seq_of(tokens, request_id)
    bm.allocate_prefix(seq, bm.cached_prefix(seq))
    bm.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_blocks(seq)
    return seq


def test_a_block_hash_covers_its_parent_and_its_tokens():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert a != hash_block(None, [1, 2, 3, 5])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])  # same tokens, other prefix
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(a, [5, 6, 7, 8], b"other input")


def test_full_blocks_are_hashed_once_and_never_over_a_token_on_the_device():
    seq = seq_of(list(range(10)))
    assert hash_full_blocks(seq, BS, 10) == 2  # tokens 8 and 9 do not fill a block
    assert seq.block_hashes == [hash_block(None, [0, 1, 2, 3]), hash_block(seq.block_hashes[0], [4, 5, 6, 7])]
    seq.append_token(10)
    seq.append_token(PLACEHOLDER_TOKEN)  # sampled, not yet read back
    assert hash_full_blocks(seq, BS, 12) == 2
    seq.output_token_ids[-1] = 11
    assert hash_full_blocks(seq, BS, 12) == 3
    assert hash_full_blocks(seq, BS, 7) == 1  # only the blocks within the first 7 tokens


def test_a_hit_reuses_the_blocks_and_counts_queries_and_hits_in_tokens():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    first = computed(bm, list(range(10)), "a")  # blocks 0, 1 full; block 2 holds tokens 8-9
    assert first.block_table == [0, 1, 2] and first.num_cached_tokens == 0
    second = seq_of(list(range(8)) + [50, 51, 52], "b")
    assert bm.cached_prefix(second) == [[0, 1]]
    bm.allocate_prefix(second, [[0, 1]])
    bm.allocate(second, second.num_uncomputed_tokens)
    assert (second.block_table, second.num_computed_tokens, second.num_cached_tokens) == ([0, 1, 3], 8, 8)
    assert bm.ref_counts.tolist() == [2, 2, 1, 1, 0, 0, 0, 0]
    assert (bm.prefix_cache_stats.queries, bm.prefix_cache_stats.hits) == (10 + 11, 8)


def test_the_last_token_is_always_computed():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    computed(bm, list(range(12)))
    assert bm.cached_prefix(seq_of(list(range(12)))) == [[0, 1]]  # not block 2: its last token gives the logits
    assert bm.cached_prefix(seq_of(list(range(13)))) == [[0, 1, 2]]
    assert bm.cached_prefix(seq_of([9] + list(range(1, 13)))) == [[]]  # a different first token: no prefix


def test_released_blocks_stay_cached_until_a_fresh_block_is_needed_tail_first():
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=True)
    old = computed(bm, list(range(12)), "old")  # blocks 0, 1, 2, all full and cached
    bm.free(old)
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.prefix_cache.num_evictable) == (6, 0, 3)
    assert list(bm.prefix_cache.evictable[0]) == [2, 1, 0]  # tail first: evicted before the head
    new = computed(bm, list(range(100, 112)), "new")  # 3 never-cached blocks are free: nothing is evicted
    assert new.block_table == [3, 4, 5] and bm.prefix_cache.num_cached_blocks == 6
    bm.free(new)
    other = seq_of(list(range(200, 208)), "other")
    bm.allocate(other, 8)  # two fresh blocks: the least recently used cached ones, old's tail
    assert other.block_table == [2, 1]
    assert bm.cached_prefix(seq_of(list(range(13)))) == [[0]]  # old's blocks 1 and 2 are gone from the table
    assert bm.cached_prefix(seq_of(list(range(100, 113)))) == [[3, 4, 5]]


def test_a_block_reused_after_eviction_never_serves_its_old_content():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    bm.free(computed(bm, list(range(8)) + [99], "a"))  # blocks 0, 1 cached, block 2 never full
    b = computed(bm, list(range(50, 66)), "b")  # needs 4 blocks: takes the free ones, then evicts 1 and 0
    assert b.block_table == [3, 2, 1, 0]
    assert bm.cached_prefix(seq_of(list(range(9)))) == [[]]
    assert bm.cached_prefix(seq_of(list(range(50, 63)))) == [[3, 2, 1]]  # b's content now


def test_allocation_counts_a_hit_on_an_evictable_block_as_taken():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    bm.free(computed(bm, list(range(8)) + [99]))  # blocks 0, 1 evictable; 2, 3 free
    seq = seq_of(list(range(8)) + list(range(60, 72)))  # 20 tokens: 5 blocks, 2 of them cached
    prefix = bm.cached_prefix(seq)
    assert prefix == [[0, 1]] and bm.num_free_blocks == 4
    assert not bm.can_allocate_with_prefix(seq, prefix)  # 3 fresh + 2 revived > 4
    shorter = seq_of(list(range(8)) + list(range(60, 66)))  # 14 tokens: 4 blocks, 2 cached
    assert bm.can_allocate_with_prefix(shorter, prefix) and not bm.can_allocate_with_prefix(shorter, prefix, reserve=1)


def test_identical_content_computed_twice_is_cached_once():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    a, b = computed(bm, list(range(9)), "a"), seq_of(list(range(9)), "b")
    b.block_table = []
    bm.allocate(b, 9)  # admitted in the same step as a: no hit, computes the same blocks
    b.num_computed_tokens = 9
    bm.cache_blocks(b)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4, 5])
    assert bm.prefix_cache.num_cached_blocks == 2
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and np.all(bm.ref_counts == 0)
    assert list(bm.free_block_ids)[-4:] == [2, 5, 4, 3]  # b's blocks, not cached, are plainly free


def test_without_prefix_caching_nothing_is_cached_or_counted():
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = computed(bm, list(range(9)))
    bm.free(seq)
    assert bm.cached_prefix(seq_of(list(range(9)))) == [[]] and bm.prefix_cache is None
    assert (bm.prefix_cache_stats.queries, bm.prefix_cache_stats.hits, seq.num_cached_tokens) == (0, 0, 0)
    assert list(bm.free_block_ids) == [3, 0, 1, 2]


def test_a_sequence_that_asks_for_prompt_logprobs_computes_its_whole_prompt():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    computed(bm, list(range(9)))
    seq = seq_of(list(range(9)))
    seq.use_prefix_cache = False
    assert bm.cached_prefix(seq) == [[]]


def test_the_scheduler_starts_the_first_chunk_after_the_cached_prefix():
    grid = BucketGrid(SPEC, block_size=BS, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16,
                      num_blocks=32)
    bm = BlockManager(32, BS, enable_prefix_caching=True)
    scheduler = Scheduler(bm, grid, max_num_seqs=8, max_num_batched_tokens=16)
    first = seq_of(list(range(1, 17)), "first")
    scheduler.add(first)
    sched = scheduler.schedule()
    assert [(c.start, c.num_tokens) for c in sched.prefill_chunks] == [(0, 16)]
    advance(sched, [7])
    bm.cache_blocks(first)  # the engine does this once the step is dispatched
    second = seq_of(list(range(1, 13)) + [40, 41, 42, 43, 44], "second")  # 17 tokens, the first 12 cached
    scheduler.add(second)
    sched = scheduler.schedule()
    chunk = next(c for c in sched.prefill_chunks if c.seq is second)
    assert (chunk.start, chunk.num_tokens, second.num_computed_tokens) == (12, 5, 12)
    assert second.block_table[:3] == first.block_table[:3] and len(second.block_table) == 5
    assert second.status is SequenceStatus.RUNNING and second.num_cached_tokens == 12


@pytest.mark.parametrize("cached", [True, False])
def test_preemption_keeps_the_computed_blocks_cached(cached):
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=cached)
    seq = computed(bm, list(range(10)))
    bm.free(seq)
    seq.reset_for_recompute()
    assert bm.cached_prefix(seq) == [[0, 1] if cached else []]
    assert seq.num_cached_tokens == 0  # the first admission's count stays the request's


def test_cache_events_record_runs_of_stored_blocks_and_each_eviction():
    """What KV-aware routers are told (`engine/kv_events.py`): one BlocksStored per run of a sequence's blocks
    that entered the cache (its parent: the block before the run), a BlocksRemoved per evicted block; content another
    block already caches, and the same blocks offered again, are no event."""
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=True)
    assert bm.take_cache_events() == []  # not recorded until asked for
    bm.cache_events = []
    a = computed(bm, list(range(8)) + [99], "a")  # blocks 0, 1 cached, block 2 never full
    h = a.block_hashes
    assert bm.take_cache_events() == [BlocksStored(h[:2], None, list(range(8)))]
    bm.cache_blocks(a)
    twin = seq_of(list(range(8)), "twin")
    bm.allocate(twin, 8)  # computed the same content beside a: cached once
    twin.num_computed_tokens = 8
    bm.cache_blocks(twin)
    assert bm.take_cache_events() == []
    bm.free(twin)
    longer = seq_of(list(range(8)) + [99, 98, 97, 96], "longer")
    bm.allocate_prefix(longer, bm.cached_prefix(longer))
    bm.allocate(longer, longer.num_uncomputed_tokens)
    longer.num_computed_tokens = longer.num_tokens
    bm.cache_blocks(longer)  # its third block follows a's two: its parent is a's second
    assert bm.take_cache_events() == [BlocksStored(longer.block_hashes[2:3], h[1], [99, 98, 97, 96])]
    bm.free(a)
    bm.free(longer)
    b = computed(bm, list(range(50, 74)), "b")  # 6 blocks: 3 free, then every cached one, least recently used first
    events = bm.take_cache_events()
    assert events[:3] == [BlocksRemoved([longer.block_hashes[2]]), BlocksRemoved([h[1]]), BlocksRemoved([h[0]])]
    assert events[3:] == [BlocksStored(b.block_hashes, None, list(range(50, 74)))]


def test_a_reset_drops_every_cached_block_nobody_holds():
    """vLLM's reset_prefix_cache (the server's /flush_cache): released cached blocks leave the cache and become free,
    held ones stay; the events say which left (AllBlocksCleared when nothing stays cached)."""
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    bm.cache_events = []
    a = computed(bm, list(range(8)) + [99], "a")
    b = computed(bm, list(range(20, 28)) + [99], "b")
    bm.free(a)
    bm.take_cache_events()
    free_before = len(bm.free_block_ids)
    assert bm.reset_prefix_cache() == 2  # a's two full blocks; b still holds its own
    assert bm.take_cache_events() == [BlocksRemoved([a.block_hashes[1], a.block_hashes[0]])]  # LRU: tail first
    assert len(bm.free_block_ids) == free_before + 2 and bm.num_free_blocks == free_before + 2
    assert bm.cached_prefix(seq_of(list(range(8)) + [99], "again")) == [[]]
    assert bm.cached_prefix(seq_of(list(range(20, 28)) + [99], "b again")) == [b.block_table[:2]]
    bm.free(b)
    assert bm.reset_prefix_cache() == 2
    assert bm.take_cache_events() == [AllBlocksCleared()]
    assert bm.prefix_cache.num_cached_blocks == 0 and bm.num_free_blocks == 8
    assert bm.reset_prefix_cache() == 0 and bm.take_cache_events() == []
    assert BlockManager(num_blocks=4, block_size=BS).reset_prefix_cache() == 0  # no prefix caching: nothing cached
