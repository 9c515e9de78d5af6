import numpy as np
import pytest

from jaxserve.core.block_manager import BlockManager
from jaxserve.core.sequence import Sequence, SequenceStatus


def make_seq(num_prompt_tokens: int, request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(range(num_prompt_tokens)), arrival_time=0.0)


def forked_six_token_prompt() -> tuple[BlockManager, Sequence, Sequence]:
    """A 6-token prompt computed in a 6-block pool of 4-token blocks (blocks 0 and 1), then forked."""
    bm = BlockManager(num_blocks=6, block_size=4)
    parent = make_seq(6)
    bm.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork()
    bm.fork(parent, child)
    return bm, parent, child


def test_allocate_prefill_then_decode_across_block_boundaries():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(6)
    assert bm.num_new_blocks(seq, 6) == 2
    bm.allocate(seq, 6)
    assert seq.block_table == [0, 1]
    assert (bm.num_free_blocks, bm.num_used_blocks) == (6, 2)
    seq.num_computed_tokens = 6
    seq.append_token(100)
    # decode tokens 7 and 8 fit in block 1; token 9 needs a new block
    bm.allocate(seq, 1)
    assert seq.block_table == [0, 1]
    seq.num_computed_tokens = 7
    seq.append_token(101)
    bm.allocate(seq, 1)
    assert seq.block_table == [0, 1]
    seq.num_computed_tokens = 8
    seq.append_token(102)
    assert bm.num_new_blocks(seq, 1) == 1
    bm.allocate(seq, 1)
    assert seq.block_table == [0, 1, 2]
    assert bm.ref_counts.tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    # allocate is idempotent for tokens already covered
    bm.allocate(seq, 1)
    assert seq.block_table == [0, 1, 2]


def test_prefill_chunks_grow_the_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(13)
    bm.allocate(seq, 5)  # tokens [0, 5)
    assert seq.block_table == [0, 1]
    seq.num_computed_tokens = 5
    bm.allocate(seq, 8)  # tokens [5, 13)
    assert seq.block_table == [0, 1, 2, 3]
    assert bm.num_free_blocks == 4


def test_can_allocate_and_reserve():
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = make_seq(12)
    assert bm.can_allocate(seq, 12)
    assert not bm.can_allocate(seq, 13)
    assert not bm.can_allocate(seq, 12, reserve=1)
    assert bm.can_allocate(seq, 8, reserve=1)
    with pytest.raises(RuntimeError, match="needs 4 new KV blocks, only 3 free"):
        bm.allocate(seq, 13)
    assert seq.block_table == [] and bm.num_free_blocks == 3


def test_free_returns_everything_in_order():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = make_seq(3, "a"), make_seq(4, "b")
    bm.allocate(a, 3)
    bm.allocate(b, 4)
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    bm.free(a)
    assert a.block_table == []
    assert list(bm.free_block_ids) == [4, 5, 0, 1]
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.num_used_blocks == 0
    assert not bm.ref_counts.any()
    c = make_seq(5, "c")
    bm.allocate(c, 5)
    assert c.block_table == [4, 5, 0]


def test_fork_shares_blocks_with_ref_counts():
    bm, parent, child = forked_six_token_prompt()
    assert child.block_table == [0, 1]
    assert child.seq_id != parent.seq_id and child.num_computed_tokens == 6
    assert bm.ref_counts.tolist() == [2, 2, 0, 0, 0, 0]
    assert bm.num_used_blocks == 2
    bm.free(parent)
    assert bm.ref_counts.tolist() == [1, 1, 0, 0, 0, 0]
    assert bm.num_free_blocks == 4  # still held by the child
    bm.free(child)
    assert bm.num_free_blocks == 6


def test_fork_into_a_sequence_with_blocks_raises():
    bm = BlockManager(num_blocks=6, block_size=4)
    parent, other = make_seq(4), make_seq(4)
    bm.allocate(parent, 4)
    bm.allocate(other, 4)
    with pytest.raises(ValueError, match="cannot fork into a sequence that already has blocks"):
        bm.fork(parent, other)
    assert bm.ref_counts.tolist() == [1, 1, 0, 0, 0, 0]


def test_copy_on_write_of_a_shared_last_block():
    bm, parent, child = forked_six_token_prompt()
    # the next token (index 6) goes into block 1, shared: the child gets a private copy
    assert bm.copy_on_write(child) == [(1, 2)]
    assert child.block_table == [0, 2] and parent.block_table == [0, 1]
    assert bm.ref_counts.tolist() == [2, 1, 1, 0, 0, 0]
    assert bm.copy_on_write(parent) == []  # block 1 is the parent's alone now


def test_allocate_copies_a_shared_block_before_it_is_written():
    bm, parent, child = forked_six_token_prompt()
    assert bm.num_new_blocks(child, 1) == 1  # token 6 goes into block 1, shared: a private copy is needed
    assert bm.can_allocate(child, 1, reserve=3) and not bm.can_allocate(child, 1, reserve=4)
    bm.allocate(child, 1)
    assert child.block_table == [0, 2] and parent.block_table == [0, 1]
    assert bm.ref_counts.tolist() == [2, 1, 1, 0, 0, 0]
    assert bm.num_new_blocks(parent, 1) == 0  # block 1 is the parent's alone now
    child.num_computed_tokens = 8
    child.append_token(7)
    child.append_token(8)
    bm.allocate(child, 1)  # a new block, nothing shared to copy
    assert child.block_table == [0, 2, 3]
    assert bm.take_pending_copies() == [(1, 2)] and bm.take_pending_copies() == []


def test_a_chunk_over_several_shared_blocks_copies_each():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(12)
    bm.allocate(parent, 12)
    child = parent.fork()
    bm.fork(parent, child)
    child.num_computed_tokens = 2  # re-writes tokens 2..9: blocks 0, 1 and 2
    assert bm.num_new_blocks(child, 8) == 3
    bm.allocate(child, 8)
    assert child.block_table == [3, 4, 5] and bm.take_pending_copies() == [(0, 3), (1, 4), (2, 5)]


def forked_writer(bm: BlockManager, parent: Sequence) -> Sequence:
    """A fork of ``parent`` about to write its last prompt token (into the shared last block)."""
    child = parent.fork()
    bm.fork(parent, child)
    child.num_computed_tokens = parent.num_tokens - 1
    return child


def test_pending_copies_skip_freed_destinations_and_keep_the_latest():
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = make_seq(4, "a"), make_seq(4, "b")
    bm.allocate(a, 4)
    bm.allocate(b, 4)
    a_child = forked_writer(bm, a)
    bm.allocate(a_child, 1)  # block 0 -> 2
    bm.free(a_child)  # preempted before the copy ran: block 2 is free again ...
    b_child = forked_writer(bm, b)
    bm.allocate(b_child, 1)  # ... and receives block 1's copy instead
    assert bm.pending_copies == [(0, 2), (1, 2)]
    assert bm.take_pending_copies() == [(1, 2)]

    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(4, "a")
    bm.allocate(a, 4)
    a_child = forked_writer(bm, a)
    bm.allocate(a_child, 1)
    bm.free(a_child)  # freed and not handed out again: its copy is dropped
    assert bm.take_pending_copies() == []


def test_double_free_and_unknown_block_raise():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(8)
    bm.allocate(seq, 8)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(ValueError, match="double free of KV block 0"):
        bm.free(seq)
    seq.block_table = [7]
    with pytest.raises(ValueError, match="unknown KV block 7"):
        bm.free(seq)
    # a failed free changes nothing
    other = make_seq(4)
    bm.allocate(other, 4)
    seq.block_table = [other.block_table[0], other.block_table[0]]
    with pytest.raises(ValueError, match="double free"):
        bm.free(seq)
    assert bm.ref_counts[other.block_table[0]] == 1
    assert bm.num_free_blocks == 3


def test_freeing_a_sequence_without_blocks_is_a_no_op():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.free(make_seq(3))
    assert bm.num_free_blocks == 2


def test_usage_and_kv_waste_exact():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = make_seq(5, "a"), make_seq(8, "b")
    bm.allocate(a, 5)
    bm.allocate(b, 8)
    a.num_computed_tokens, b.num_computed_tokens = 5, 8
    assert bm.usage == pytest.approx(0.4)
    # a: 8 slots, 5 used; b: 8 slots, 8 used -> (16 - 13) / 16
    assert bm.kv_waste([a, b]) == pytest.approx(3 / 16)
    assert bm.kv_waste([b]) == 0.0
    assert bm.kv_waste([]) == 0.0
    # slots reserved for a chunk that has not run yet count as waste until it runs
    a.append_token(1)
    bm.allocate(a, 4)  # holds up to 9 tokens -> 3 blocks
    assert bm.kv_waste([a]) == pytest.approx(7 / 12)
    assert bm.usage == pytest.approx(0.5)


def test_ref_counts_are_int32_numpy():
    bm = BlockManager(num_blocks=3, block_size=1)
    assert bm.ref_counts.dtype == np.int32


def test_sequence_token_accounting():
    seq = Sequence("r", [5, 6, 7], arrival_time=1.0)
    assert seq.status is SequenceStatus.WAITING and not seq.is_finished
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (3, 3, 0)
    assert seq.is_prefill and seq.num_uncomputed_tokens == 3 and seq.last_token_id == 7
    seq.num_computed_tokens = 3
    seq.append_token(8)
    assert seq.all_token_ids == [5, 6, 7, 8] and seq.last_token_id == 8
    assert seq.num_uncomputed_tokens == 1 and not seq.is_prefill
    assert SequenceStatus.is_finished(SequenceStatus.FINISHED_LENGTH)
    assert not SequenceStatus.RUNNING.is_finished()
    with pytest.raises(ValueError, match="at least one token"):
        Sequence("r", [])
