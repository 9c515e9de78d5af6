"""Step inputs from a Schedule's rows (`runner/input_batch.py`): exact arrays for padded and ragged buckets,
placeholder tokens fed from the previous step, and the counts a new sampler slot starts with."""

from __future__ import annotations

import numpy as np

from jaxserve.core.buckets import DecodeBucket, MixedBucket, PrefillBucket
from jaxserve.core.sequence import PLACEHOLDER_TOKEN, Sequence
from jaxserve.runner.input_batch import StepShape, initial_token_counts, prepare_step_inputs, step_shape
from jaxserve.runner.sampler import PAD_FLOATS, SamplingRow

V = 32


def test_a_slot_starts_with_its_whole_prompt_mask_and_earlier_generated_counts():
    seq = Sequence("r", [5, 7, 5, 9])
    seq.output_token_ids += [7, 11, 11, 3]
    for start, generated in [(0, []), (2, []), (4, []), (7, [7, 11, 11])]:  # 7: a cached prefix past the prompt
        counts, prompt = initial_token_counts(seq, start, V)
        np.testing.assert_array_equal(prompt, np.isin(np.arange(V), [5, 7, 9]))
        np.testing.assert_array_equal(counts, np.bincount(np.array(generated, int), minlength=V))


def _seq(prompt: list[int], outputs: list[int], blocks: list[int]) -> Sequence:
    seq = Sequence("r", prompt)
    seq.output_token_ids += outputs
    seq.block_table = blocks
    return seq


def _row(slot: int | None = None) -> SamplingRow:
    return SamplingRow(PAD_FLOATS, seed=7, slot=slot)


def test_step_shapes_of_the_bucket_kinds():
    assert step_shape(PrefillBucket(2, 32, 64), block_size=16) == StepShape(2, 32, 4)
    assert step_shape(DecodeBucket(8, 100), block_size=16) == StepShape(8, 1, 7)  # ceil(100 / 16) pages
    assert step_shape(MixedBucket(64, 4, 128), block_size=16) == StepShape(4, 64, 8, ragged=True)
    assert StepShape(4, 64, 8, ragged=True).input_shape == (1, 64)
    assert StepShape(2, 32, 4).input_shape == (2, 32)


def test_a_padded_step_puts_each_row_at_its_own_row():
    a = _seq([11, 12, 13, 14, 15], [], [3, 4])
    b = _seq([21, 22], [23], [5])
    rows = [(a, 0, 4), (b, 2, 1)]  # a's first chunk of 4, b's decode token (its position 2)
    inputs = prepare_step_inputs(rows, StepShape(3, 4, 2), [_row(0), _row()], {}, no_slot=9, vocab_size=V)
    np.testing.assert_array_equal(inputs.input_ids, [[11, 12, 13, 14], [23, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(inputs.block_tables, [[3, 4], [5, 0], [0, 0]])
    np.testing.assert_array_equal(inputs.q_start, [0, 2, 0])
    np.testing.assert_array_equal(inputs.lengths, [4, 3, 0])
    np.testing.assert_array_equal(inputs.sample_index, [3, 0, 0])
    np.testing.assert_array_equal(inputs.feed_cols, [-1, -1, -1])
    assert inputs.query_starts is None
    np.testing.assert_array_equal(inputs.sampling.ints[:, 4], [0, 9, 9])  # slots: a's, then no_slot


def test_a_ragged_step_puts_rows_back_to_back_and_feeds_placeholders():
    decoding = _seq([1, 2, 3], [4, PLACEHOLDER_TOKEN], [7])  # its last token is still on the device
    prefill = _seq([31, 32, 33, 34, 35, 36], [], [8, 9, 10])  # block 10 reserved ahead, past this step
    rows = [(decoding, 4, 1), (prefill, 0, 3)]
    inputs = prepare_step_inputs(rows, StepShape(4, 8, 2, ragged=True), [_row(), _row()], {decoding.seq_id: 5},
                                 no_slot=9, vocab_size=V)
    np.testing.assert_array_equal(inputs.input_ids, [[PLACEHOLDER_TOKEN, 31, 32, 33, 0, 0, 0, 0]])
    np.testing.assert_array_equal(inputs.query_starts, [0, 1, 8, 8])  # padding rows start past the last token
    np.testing.assert_array_equal(inputs.block_tables, [[7, 0], [8, 9], [0, 0], [0, 0]])
    np.testing.assert_array_equal(inputs.q_start, [4, 0, 0, 0])
    np.testing.assert_array_equal(inputs.lengths, [5, 3, 0, 0])
    np.testing.assert_array_equal(inputs.sample_index, [0, 2, 0, 0])
    # the decoding row's one token is row 5 of the previous step's output, at column 0
    np.testing.assert_array_equal(inputs.feed_rows, [5, 0, 0, 0])
    np.testing.assert_array_equal(inputs.feed_cols, [0, -1, -1, -1])
