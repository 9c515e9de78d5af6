"""KV cache groups on the host: the layout of a model's layers in groups, and the block manager keeping one table per
group, a sliding group giving back what its window no longer reaches through growth, forks, copy-on-write and
prefix caching (vLLM's hybrid rule)."""

import collections
import random

import pytest

from jaxserve.config.kv_cache_groups import NULL_BLOCK, first_kept_token, layout_for
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.prefix_cache import hash_full_blocks
from jaxserve.core.sequence import Sequence

N = NULL_BLOCK
BS, WINDOW = 4, 4  # a sliding group keeps the tokens from first_kept_token = computed - 5 on


def seq_of(num_tokens: int, first: int = 0) -> Sequence:
    return Sequence("r", list(range(first, first + num_tokens)), arrival_time=0.0)


def hybrid(num_blocks: int = 40, **kwargs) -> BlockManager:
    """A full group and a sliding one, as Gemma 2's or gpt-oss's alternating layers."""
    return BlockManager(num_blocks, BS, group_windows=(None, WINDOW), **kwargs)


def test_gemma3_270m_is_one_full_group_and_five_sliding_groups_of_three_layers():
    layout = layout_for(tuple(layer % 6 != 5 for layer in range(18)), 512)
    assert (layout.num_groups, layout.layers_per_group) == (6, 3)
    assert layout.windows == (None, 512, 512, 512, 512, 512)
    assert [group.layers for group in layout.groups[:3]] == [(5, 11, 17), (0, 1, 2), (3, 4, 6)]
    assert [(layout.group_of[layer], layout.slot_of[layer]) for layer in (5, 11, 17, 0, 2, 3, 6, 16)] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 2), (5, 2)]
    # a request of 8,192 tokens, chunks of 2,048: every token in the full group; in each other the window, the block
    # two tokens before it and the chunk, one block more where they straddle blocks: (512 + 1 + 2048) / 16 + 1
    assert layout.blocks_per_request(8192, 16, 2048) == 512 + 5 * 162


def test_alternating_layers_are_two_groups_and_alike_layers_one():
    gpt_oss = layout_for(tuple(layer % 2 == 0 for layer in range(24)), 128)
    assert (gpt_oss.num_groups, gpt_oss.layers_per_group, gpt_oss.windows) == (2, 12, (None, 128))
    assert gpt_oss.groups[1].layers == tuple(range(0, 24, 2))
    assert layout_for((False,) * 4, None).windows == (None,)
    assert layout_for((True,) * 4, 4096).windows == (4096,)  # every layer slides (Mistral): one sliding group
    assert layout_for((True, False) * 2, 64, hybrid=False).windows == (None,)  # vLLM's disable_hybrid_kv_cache_manager
    uneven = layout_for((False,) * 2 + (True,) * 5, 8)  # 2 full, 5 sliding: groups of 2, the last one short
    assert [group.layers for group in uneven.groups] == [(0, 1), (2, 3), (4, 5), (6,)]
    assert uneven.layers_per_group == 2


def test_gemma4_groups_hold_one_page_shape_and_its_kv_sharing_layers_read_their_sources_rows():
    """Gemma 4 E2B-like: 12 layers, full every sixth and the last; the last 4 layers keep no cache and read the last
    earlier layer of their type (7 sliding, 11 full -> 5); full layers' pages are of another shape (kind 1)."""
    slides = tuple(layer not in (5, 11) for layer in range(12))
    kinds = tuple(0 if s else 1 for s in slides)
    readers = ((8, 7), (9, 7), (10, 7), (11, 5))
    layout = layout_for(slides, 512, layer_kinds=kinds, readers=readers)
    # owners: full 5 (kind 1), sliding 0-4, 6, 7: groups of one layer (the fewest of one kind)
    assert [(group.layers, group.sliding_window) for group in layout.groups] == [
        ((5,), None), ((0,), 512), ((1,), 512), ((2,), 512), ((3,), 512), ((4,), 512), ((6,), 512), ((7,), 512)]
    assert (layout.num_kinds, layout.layers_per_group) == (2, 1)
    assert [layout.kind_of(layer) for layer in (0, 5, 8, 11)] == [0, 1, 0, 1]
    assert [(layout.group_of[layer], layout.slot_of[layer]) for layer in (7, 8, 9, 10, 11, 5)] == [
        (7, 0), (7, 0), (7, 0), (7, 0), (0, 0), (0, 0)]
    assert layout.group_kinds == (1, 0, 0, 0, 0, 0, 0, 0)
    # a request of 4,096 tokens holds 256 blocks of 16 in the full group, 34 in each sliding one; a step's chunks of
    # 64 tokens hold 5 more blocks in each sliding group: those first, the rest of the ids in proportion 7 * 34 : 256
    assert layout.kind_demand(4096, 16) == (7 * 34, 256) and layout.in_flight_blocks(16, 64) == (35, 0)
    assert layout.blocks_of_kinds(1000, 4096, 16, 64) == (35 + 965 * 238 // 494, 965 * 256 // 494 + 1)
    assert layout.max_concurrency(1000, 4096, 16, 64) == min((499 - 35) / 238, 501 / 256)
    # without the hybrid manager: a full-attention group per kind (a table spans one kind's ids)
    plain = layout_for(slides, 512, hybrid=False, layer_kinds=kinds, readers=readers)
    assert [group.layers for group in plain.groups] == [(0, 1, 2, 3, 4, 6, 7), (5,)]
    assert plain.windows == (None, None) and plain.group_kinds == (0, 1) and plain.layers_per_group == 7
    assert [plain.slot_of[layer] for layer in (0, 4, 5, 6, 7, 11)] == [0, 4, 0, 5, 6, 0]


def test_a_sliding_group_gives_back_the_blocks_its_window_left_as_the_sequence_grows():
    bm = hybrid(num_blocks=12)
    seq = seq_of(10)
    assert bm.num_new_blocks(seq, 10) == 6  # three blocks in each group
    bm.allocate(seq, 10)
    assert seq.block_tables == [[0, 1, 2], [3, 4, 5]]
    seq.num_computed_tokens = 10
    # the next query (token 10) reads tokens 7-10; tokens from 5 on are kept: sliding block 0 (tokens 0-3) goes back
    assert first_kept_token(WINDOW, 10) == 5 and bm.release_out_of_window(seq) == 1
    assert seq.block_tables == [[0, 1, 2], [N, 4, 5]] and list(bm.free_block_ids) == [6, 7, 8, 9, 10, 11, 3]
    for token in range(10, 17):  # decode to 17 computed tokens; allocate gives back first
        seq.append_token(token)
        bm.allocate(seq, 1)
        seq.num_computed_tokens += 1
    # at 12 computed both groups took a block; at 13 (tokens from 8 on kept) sliding block 4 went back; at 16 both
    # groups took another
    assert seq.block_tables == [[0, 1, 2, 6, 8], [N, N, 5, 7, 9]]
    assert bm.num_free_blocks == 12 - 8 and list(bm.free_block_ids) == [10, 11, 3, 4]
    assert bm.release_out_of_window(seq) == 1  # at 17 computed: tokens from 12 on, sliding block 5 (tokens 8-11) goes
    assert seq.block_tables[1] == [N, N, N, 7, 9]
    # held: 5 full blocks (17 of 20 slots used), 2 sliding ones (tokens 12-16: 5 of 8)
    assert bm.kv_waste([seq]) == pytest.approx(6 / 28)
    bm.free(seq)
    assert seq.block_tables == [[], []] and bm.num_free_blocks == 12


def test_a_prompt_in_chunks_holds_its_whole_length_in_the_full_group_and_its_chunk_in_the_sliding_one():
    bm = hybrid(num_blocks=16)
    seq = seq_of(40)
    # admitted whole, computed in chunks of 8: at most window + margin + chunk (4 + 4 + 8 tokens, 5 blocks) in the
    # sliding group, all 10 blocks in the full one; in one chunk, 10 in each
    assert bm.can_allocate_with_prefix(seq, [[], []], max_chunk_tokens=8)
    assert not bm.can_allocate_with_prefix(seq, [[], []])
    assert not BlockManager(14, BS, group_windows=(None, WINDOW)).can_allocate_with_prefix(seq, [[], []],
                                                                                          max_chunk_tokens=8)
    bm.allocate(seq, 40, num_sliding_tokens=8)
    assert seq.block_tables == [list(range(10)), [10, 11]]
    seq.num_computed_tokens = 8
    bm.allocate(seq, 8)
    assert seq.block_tables[1] == [10, 11, 12, 13]
    seq.num_computed_tokens = 16
    bm.allocate(seq, 8)  # tokens from 9 on kept: blocks 10 and 11 go back first
    assert seq.block_tables == [list(range(10)), [N, N, 12, 13, 14, 15]] and list(bm.free_block_ids) == [11, 10]


def test_the_scheduler_frees_what_the_windows_left_before_it_plans_a_step():
    from jaxserve.core.buckets import BucketGrid
    from jaxserve.core.scheduler import Scheduler
    from tests.core.test_scheduler import SPEC, advance

    bm = hybrid(num_blocks=64)
    grid = BucketGrid(SPEC, block_size=BS, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                      num_blocks=64)
    scheduler = Scheduler(bm, grid, max_num_seqs=4, max_num_batched_tokens=16)
    seq = seq_of(12)
    scheduler.add(seq)
    for step in range(7):  # the prompt, then decode steps up to 17 computed tokens
        advance(scheduler.schedule(), [100 + step])
    held = [[block for block in table if block != N] for table in seq.block_tables]
    assert seq.num_computed_tokens == 17 and [len(held[0]), len(held[1])] == [5, 3]
    assert seq.block_tables[1][:2] == [N, N]


def test_a_fork_keeps_the_blocks_its_parent_gives_back_and_both_copy_on_write_per_group():
    bm = hybrid(num_blocks=16)
    parent = seq_of(6)
    bm.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork()
    bm.fork(parent, child)
    assert child.block_tables == [[0, 1], [2, 3]] and bm.ref_counts[:4].tolist() == [2, 2, 2, 2]
    child.append_token(7)
    bm.allocate(child, 1)  # token 6 goes to the shared last block of each group: a private copy of both
    assert child.block_tables == [[0, 4], [2, 5]] and bm.take_pending_copies() == [(1, 4), (3, 5)]
    parent.num_computed_tokens = 12
    assert bm.release_out_of_window(parent) == 1  # its sliding block 0, which the child still holds
    assert parent.block_tables[1] == [N, 3] and bm.ref_counts[2] == 1 and 2 not in bm.free_block_ids
    bm.free(child)
    assert 2 in bm.free_block_ids


def test_a_prefix_hits_where_the_full_group_has_every_block_and_the_sliding_group_its_window():
    bm = hybrid(num_blocks=40, enable_prefix_caching=True)
    first = seq_of(25)
    bm.allocate(first, 25)
    first.num_computed_tokens = 25
    bm.cache_blocks(first)
    bm.release_out_of_window(first)  # blocks of the sliding group before token 18 stay cached, evictable
    bm.free(first)
    again = seq_of(25)
    prefix = bm.cached_prefix(again)  # six blocks: the next query (token 24) reads tokens 21-24; 17 on are kept
    assert prefix == [first_full := list(range(7))[:6], [N, N, N, N, 11, 12]] and first_full == [0, 1, 2, 3, 4, 5]
    assert bm.can_allocate_with_prefix(again, prefix)
    bm.allocate_prefix(again, prefix)
    assert again.num_computed_tokens == 24 and bm.prefix_cache_stats.hits == 24


def test_a_sliding_group_missing_a_block_of_its_window_shortens_the_hit():
    bm = hybrid(num_blocks=40, enable_prefix_caching=True)
    seq = seq_of(25)
    hashes = seq.block_hashes[: hash_full_blocks(seq, BS, 24)]
    for index, block_hash in enumerate(hashes):  # the full group caches all six blocks, the sliding one 0-3
        bm.prefix_cache.insert(index, block_hash, 0)
        if index < 4:
            bm.prefix_cache.insert(10 + index, block_hash, 1)
    # 6 blocks need sliding blocks 4-5, 5 blocks need 3-4: the longest hit is 4 blocks (sliding 2-3)
    assert bm.cached_prefix(seq) == [[0, 1, 2, 3], [N, N, 12, 13]]
    assert bm.cached_prefix(seq_of(25, first=1)) == [[], []]  # other tokens: nothing


def test_a_sequence_keeps_its_tables_group_count():
    bm = hybrid()
    seq = seq_of(4)
    seq.block_table = [7]  # a one-group table on a two-group pool
    with pytest.raises(ValueError, match="1 block tables, the pool has 2 KV cache groups"):
        bm.allocate(seq, 4)
    with pytest.raises(ValueError, match="a cached prefix of 1 groups, the pool has 2"):
        bm.allocate_prefix(seq_of(4), [[]])


@pytest.mark.parametrize("trial", range(12))
def test_random_admissions_steps_forks_and_frees_keep_the_books(trial):
    """Seeded random operations on pools of one to three groups: every held block is counted once per table that
    holds it, in one group only; free, evictable and held blocks partition the pool; each sliding table keeps every
    block a query up to two tokens back reads."""
    rng = random.Random(trial)
    block_size = rng.choice([1, 2, 4])
    windows = [(None,), (None, 3), (None, 5, 5), (4,), (None, 2, 7)][trial % 5]
    bm = BlockManager(rng.randint(20, 80), block_size, enable_prefix_caching=trial % 3 > 0, group_windows=windows)
    seqs: list[Sequence] = []
    for _ in range(150):
        _random_operation(bm, seqs, rng)
        _check_books(bm, seqs)


def _random_operation(bm: BlockManager, seqs: list[Sequence], rng: random.Random) -> None:
    op = rng.random()
    if op < 0.25 and len(seqs) < 8:  # admit a prompt (on its cached prefix), its first chunk in the sliding groups
        seq = Sequence("r", [rng.randrange(3) for _ in range(rng.randint(1, 20))], arrival_time=0.0)
        prefix, chunk = bm.cached_prefix(seq), rng.randint(1, 8)
        if bm.can_allocate_with_prefix(seq, prefix, max_chunk_tokens=chunk):
            bm.allocate_prefix(seq, prefix)
            if bm.can_allocate(seq, seq.num_uncomputed_tokens):
                bm.allocate(seq, seq.num_uncomputed_tokens, num_sliding_tokens=chunk)
                seqs.append(seq)
            else:
                bm.free(seq)
    elif op < 0.6 and seqs:  # a step: the next chunk of the prompt, or a decode token
        seq = rng.choice(seqs)
        n = min(seq.num_uncomputed_tokens, rng.randint(1, 8))
        if not bm.can_allocate(seq, n):
            bm.free(seq)
            seqs.remove(seq)
            return
        bm.allocate(seq, n)
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(rng.randrange(3))
        bm.cache_blocks(seq)
    elif op < 0.7 and seqs and len(seqs) < 8:
        parent = rng.choice(seqs)
        child = parent.fork()
        bm.fork(parent, child)
        seqs.append(child)
    elif op < 0.85 and seqs:
        seq = rng.choice(seqs)
        bm.free(seq)
        seqs.remove(seq)
    elif op < 0.9:
        for seq in seqs:
            bm.release_out_of_window(seq)
    else:
        bm.reset_prefix_cache()


def _check_books(bm: BlockManager, seqs: list[Sequence]) -> None:
    refs, group_of = collections.Counter(), {}
    for seq in seqs:
        for group, (window, table) in enumerate(zip(bm.group_windows, bm.tables(seq), strict=True)):
            held = [block for block in table if block != N]
            refs.update(held)
            assert all(group_of.setdefault(block, group) == group for block in held)
            # a query two tokens back (a fork re-decoding the last prompt token of a parent a step ahead) reads from
            # computed - 2 - window + 1 on: those blocks are all held
            needed = 0 if window is None else max(0, seq.num_computed_tokens - window - 1)
            assert N not in table[needed // bm.block_size : -(-seq.num_computed_tokens // bm.block_size)]
    assert bm.ref_counts.tolist() == [refs[block] for block in range(bm.num_blocks)]
    free = set(bm.free_block_ids)
    evictable = {block for blocks in bm.prefix_cache.evictable for block in blocks} if bm.prefix_cache else set()
    assert not free & evictable and not (free | evictable) & set(refs)
    assert len(free) + len(evictable) + len(refs) == bm.num_blocks
