"""The step runner's interface (`runner/step_runner.py`) over a recording stand-in for the ModelRunner: sampler
slots assigned, written, copied on forks and freed; the previous step's tokens fed to placeholder rows; rows
whose grammar mask waits taking their argmax until `resample`; results read back per row, a verifying step's
accepted drafts first."""

from __future__ import annotations

import types

import numpy as np

from jaxserve.core.buckets import DecodeBucket, PrefillBucket
from jaxserve.core.schedule import PrefillChunk, Schedule
from jaxserve.core.sequence import PLACEHOLDER_TOKEN, Sequence
from jaxserve.runner.logprobs import TokenLogprobs
from jaxserve.runner.model_runner import StepOutput
from jaxserve.runner.sampler import FLAG_GRAMMAR, FLAG_LOGPROBS, INT_COLUMNS, PAD_FLOATS, SamplingRow
from jaxserve.runner.spec_verify import VerifyInputs
from jaxserve.runner.step_runner import LaunchedStep, SampledToken, StepResult, StepRunner, host_logprobs

V = 40
SLOT, FLAGS = INT_COLUMNS.index("slot"), INT_COLUMNS.index("flags")


class RecordingModel:
    """Takes the ModelRunner's device calls and records them; a step's tokens are 100 + its row."""

    num_kv_groups = 1
    group_block_offsets = (0,)

    def __init__(self):
        self.calls = []

    def execute(self, bucket, inputs, prev_tokens=None):
        self.calls.append(("execute", inputs, prev_tokens))
        tokens = np.arange(100, 100 + len(inputs.sample_index), dtype=np.int32)
        return StepOutput(tokens, None, _logprobs(len(tokens)), None)

    def resample(self, output, sampling):
        self.calls.append(("resample", sampling))
        return output.replace(tokens=output.tokens + 50)

    def copy_blocks(self, block_copies, slot_copies):
        self.calls.append(("copy_blocks", block_copies, slot_copies))

    def write_slot(self, slot, logit_bias, min_tokens_mask, output_counts, prompt_mask):
        self.calls.append(("write_slot", slot, logit_bias, prompt_mask))

    def named(self, name):
        return [call for call in self.calls if call[0] == name]


def _logprobs(n: int) -> TokenLogprobs:
    return TokenLogprobs(-np.arange(n, dtype=np.float32), np.arange(n, dtype=np.int32) + 1,
                         np.zeros((n, 2), np.int32), np.zeros((n, 2), np.float32))


class Request:
    """A row's request: a slot when ``bias`` is given, a waiting mask when ``waits``."""

    def __init__(self, *, bias: float | None = None, waits: bool = False, flags: int = 0):
        self.bias, self.waits, self.flags = bias, waits, flags

    def sampling_row(self, seq, start, num_tokens):
        return SamplingRow(PAD_FLOATS, seed=1, prompt_len=seq.num_prompt_tokens, flags=self.flags)

    def needs_slot(self):
        return self.bias is not None

    def slot_rows(self):
        return np.full(V, self.bias, np.float32), np.zeros(V, bool)

    def mask_waits(self, seq):
        return self.waits and seq.last_token_id == PLACEHOLDER_TOKEN


def _runner() -> tuple[StepRunner, RecordingModel]:
    model = RecordingModel()
    grid = types.SimpleNamespace(block_size=4, max_num_seqs=3)
    return StepRunner(model, grid, V), model


def _prefill(seq: Sequence) -> Schedule:
    seq.block_table = [1]
    return Schedule(prefill_chunks=[PrefillChunk(seq, 0, seq.num_tokens)], bucket=PrefillBucket(1, 4, 8))


def _decode(*seqs: Sequence) -> Schedule:
    return Schedule(decode_seqs=list(seqs), bucket=DecodeBucket(2, 8))


def _launch(runner: StepRunner, schedule: Schedule, requests: list[Request], block_copies) -> LaunchedStep:
    """What the engine does: the schedule's bucket and rows, as planned, with each row's request."""
    return runner.launch(schedule.bucket, schedule.rows, requests, block_copies)


def _sampled(schedule: Schedule) -> None:
    """What the engine does after a launch: the rows count as computed and each sampling row gets a placeholder."""
    for row in schedule.advance():
        schedule.rows[row][0].output_token_ids.append(PLACEHOLDER_TOKEN)


def test_a_sequence_with_penalties_gets_a_slot_written_once_and_freed_on_release():
    runner, model = _runner()
    seq = Sequence("a", [3, 4, 5])
    step = _launch(runner, _prefill(seq), [Request(bias=2.0)], [])
    (_, slot, bias, prompt_mask), = model.named("write_slot")
    assert slot == runner.slots.get(seq.seq_id) == 0 and bias[0] == 2.0
    np.testing.assert_array_equal(np.flatnonzero(prompt_mask), [3, 4, 5])
    assert step.sampling.ints[0, SLOT] == 0
    seq.num_computed_tokens = 3
    seq.output_token_ids.append(7)
    _launch(runner, _decode(seq), [Request(bias=2.0)], [])
    assert len(model.named("write_slot")) == 1  # the slot is kept, not written again
    runner.release(seq)
    assert runner.slots.get(seq.seq_id) is None and runner.slots.num_free == 3


def test_a_fork_copies_its_parents_slot_with_the_blocks_before_the_next_step():
    runner, model = _runner()
    parent, child, plain = Sequence("a", [3, 4]), Sequence("a", [3, 4]), Sequence("b", [6])
    _launch(runner, _prefill(parent), [Request(bias=1.0)], [])
    runner.fork(parent, child)
    runner.fork(plain, Sequence("b", [6]))  # no slot to copy
    child_slot = runner.slots.get(child.seq_id)
    assert child_slot == 1 and runner.slots.num_free == 1
    _launch(runner, _prefill(child), [Request(bias=1.0)], [(5, 6)])
    assert model.named("copy_blocks") == [("copy_blocks", [(5, 6)], [(0, 1)])]
    assert len(model.named("write_slot")) == 1  # the child's slot is its parent's copy
    _launch(runner, _prefill(Sequence("c", [1])), [Request()], [])
    assert len(model.named("copy_blocks")) == 1  # copies are made once


def test_a_placeholder_row_is_fed_from_the_row_its_sequence_had_in_the_step_before():
    runner, model = _runner()
    a, b = Sequence("a", [3, 4, 5]), Sequence("b", [6, 7])
    for seq in (a, b):
        seq.num_computed_tokens, seq.block_table = seq.num_tokens - 1, [1]
    first = _decode(a, b)  # a has more tokens computed: row 0, b row 1
    _launch(runner, first, [Request(), Request()], [])
    assert model.named("execute")[0][2] is None  # nothing launched before: nothing to feed
    _sampled(first)
    _launch(runner, _decode(b), [Request()], [])
    (_, inputs, prev_tokens) = model.named("execute")[1]
    np.testing.assert_array_equal(prev_tokens, [100, 101])
    assert (inputs.input_ids[0, 0], inputs.feed_rows[0], inputs.feed_cols[0]) == (PLACEHOLDER_TOKEN, 1, 0)


def test_a_row_whose_mask_waits_takes_its_argmax_until_resample_gives_its_mask():
    runner, model = _runner()
    seq = Sequence("a", [3, 4])
    seq.num_computed_tokens, seq.block_table = 1, [1]
    first = _decode(seq)
    _launch(runner, first, [Request(waits=True, flags=FLAG_LOGPROBS)], [])
    _sampled(first)
    step = _launch(runner, _decode(seq), [Request(waits=True, flags=FLAG_LOGPROBS)], [])
    assert step.late_mask_rows == frozenset({0})
    (_, inputs, _) = model.named("execute")[1]
    assert inputs.sampling.ints[0, FLAGS] == 0  # argmax only: no logprobs, no grammar
    assert step.sampling.ints[0, FLAGS] == FLAG_LOGPROBS  # as the row asked
    mask = np.zeros(2, np.int32)
    mask[0] = 1 << 5
    runner.resample(step, {0: mask})
    (_, sampling), = model.named("resample")
    assert sampling.ints[0, FLAGS] == FLAG_LOGPROBS | FLAG_GRAMMAR
    np.testing.assert_array_equal(sampling.allowed[0], mask)
    assert step.output.tokens[0] == 150
    _launch(runner, _decode(seq), [Request()], [])
    np.testing.assert_array_equal(model.named("execute")[2][2][:1], [150])  # the next step reads the resample


def test_a_verifying_steps_row_gives_its_accepted_drafts_then_its_token():
    verify = VerifyInputs.from_rows([0, 3], [3, 1], [[21, 22], []], num_positions=6, batch_size=2,
                                    num_speculative_tokens=2)
    sampling = types.SimpleNamespace(flags=np.array([FLAG_LOGPROBS, 0]))
    step = LaunchedStep(None, sampling, np.array([0, 3]), verify, frozenset())
    logprobs = host_logprobs(_logprobs(6))
    result = StepResult(step, np.array([30, 31]), logprobs, None, num_accepted=np.array([1, 0]))
    assert [s.token_id for s in result.samples(0)] == [21, 30]  # draft 22 rejected: the row's token replaces it
    assert [s.logprob for s in result.samples(0)] == [0.0, -1.0]  # at the row's sample positions 0 and 1
    (last,) = result.samples(1)
    assert (last.token_id, last.logprob, last.rank) == (31, -3.0, 4)


def test_a_plain_step_reads_logprobs_only_when_a_row_asked():
    runner, _ = _runner()
    seq = Sequence("a", [3, 4])
    quiet = runner.collect(_launch(runner, _prefill(seq), [Request()], []))
    assert quiet.logprobs is None and quiet.samples(0) == [SampledToken(100)]
    loud = runner.collect(_launch(runner, _prefill(Sequence("b", [5])), [Request(flags=FLAG_LOGPROBS)], []))
    assert (loud.samples(0)[0].logprob, loud.samples(0)[0].rank, loud.prompt_logprobs) == (0.0, 1, None)
