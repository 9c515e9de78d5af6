"""Step timing: the served mixed steps' durations that the step costs learn from, and synthetic steps for scripts.

Place in the data flow: `StepRunner.launch` stamps each step when it starts dispatching it and `StepRunner.collect`
hands the step to `ServedStepTimer.ready` once its tokens are on the host; a mixed step's seconds go to the
`StepCosts` of the scheduler's step budget (`core/cost_model.py`, `core/step_budget.py`). What is measured: the
host's wall time from the later of the step's dispatch and the previous step's readback to this step's readback.
Without async scheduling that is the step's input preparation, dispatch, device time and readback; with it the
step was dispatched while the one before still ran, so it is counted from that one's readback (its own host-side
preparation overlapped it), and host work that delays the readback (the previous step's outputs, the next step's
planning) counts too, as it delays every stream's next token. Scheduling and detokenizing outside the step
are not in it. Nothing is timed at start-up (the costs of a busy start would be frozen into the budget).

`median_step_seconds` and `probe_inputs` time a bucket's executable on synthetic rows, for the benchmark scripts.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from jaxserve.core.buckets import MixedBucket
from jaxserve.core.cost_model import StepCosts
from jaxserve.logger import init_logger
from jaxserve.runner.input_batch import StepInputs, step_shape, tables_of_every_group
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.sampler import SamplingTensors
from jaxserve.runner.spec_verify import VerifyInputs

logger = init_logger("jaxserve.runner.step_costs")

PROBE_CONTEXT = 512  # cached tokens each synthetic row attends to
PROBE_RUNS = 3
FIRST_TABLE_AT = 16  # mixed steps observed before the learned costs are first logged; then at 4x as many


class ServedStepTimer:
    """Times the steps the engine reads back and teaches their mixed buckets' costs to ``costs``."""

    def __init__(self, costs: StepCosts, token_counts: list[int], batch_sizes: list[int]):
        self.costs = costs
        self.token_counts, self.batch_sizes = token_counts, batch_sizes  # the table's rows and columns
        self._last_ready = 0.0  # perf_counter() when the last step's results reached the host
        self._next_table_at = FIRST_TABLE_AT

    def ready(self, bucket, dispatched: float, now: float | None = None) -> float:
        """A step dispatched at ``dispatched`` (`time.perf_counter()`) was read back ``now`` (default: now); a mixed
        one's seconds are observed. Returns the step's seconds as measured."""
        now = time.perf_counter() if now is None else now
        seconds = now - max(dispatched, self._last_ready)
        self._last_ready = now
        if isinstance(bucket, MixedBucket):
            self.costs.observe(bucket.num_tokens, bucket.batch_size, seconds)
            if self.costs.num_observed >= self._next_table_at:
                self._next_table_at *= 4
                logger.info("mixed step costs learned so far (%d steps; ~: estimated from the measured shapes):\n%s",
                            self.costs.num_observed, self.costs.format_table(self.token_counts, self.batch_sizes))
        return seconds


def median_step_seconds(runner: ModelRunner, bucket, inputs: StepInputs, runs: int = PROBE_RUNS) -> float:
    """Median seconds of ``runs`` steps of ``bucket`` on ``inputs``, after one untimed."""
    runner.execute(bucket, inputs).tokens.block_until_ready()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        runner.execute(bucket, inputs).tokens.block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe_inputs(runner: ModelRunner, bucket: MixedBucket) -> StepInputs:
    """Rows of a typical mixed step on ``bucket``: ``min(batch_size - 1, num_tokens // 2)`` decode rows and a
    chunk of the remaining tokens, all at ``PROBE_CONTEXT`` tokens of context (within the bucket's)."""
    shape = step_shape(bucket, runner.block_size)
    num_decode = min(bucket.batch_size - 1, bucket.num_tokens // 2)
    num_tokens = [1] * num_decode + [bucket.num_tokens - num_decode]
    context = max(0, min(PROBE_CONTEXT, bucket.context_len - max(num_tokens)))
    rows = len(num_tokens)
    query_starts = np.full(shape.batch_size, shape.num_query_tokens, np.int32)
    query_starts[:rows] = np.cumsum([0, *num_tokens[:-1]])
    q_start = np.zeros(shape.batch_size, np.int32)
    q_start[:rows] = context
    lengths = np.zeros(shape.batch_size, np.int32)
    lengths[:rows] = context + np.asarray(num_tokens)
    sample_index = np.zeros(shape.batch_size, np.int32)
    sample_index[:rows] = np.asarray(num_tokens) - 1
    sampling = SamplingTensors.from_rows([], shape.batch_size, runner.num_sampler_slots, runner.config.vocab_size)
    verify = None
    if shape.num_sample_positions:  # a speculative engine's: rows without drafts
        verify = VerifyInputs.from_rows(list(query_starts[:rows]), num_tokens, [[]] * rows, shape.num_sample_positions,
                                        shape.batch_size, shape.num_speculative_tokens)
    return StepInputs(
        input_ids=np.zeros(shape.input_shape, np.int32),
        block_tables=tables_of_every_group(np.zeros((shape.batch_size, shape.pages_per_seq), np.int32),
                                           runner.num_kv_groups),
        q_start=q_start, lengths=lengths, sample_index=sample_index, sampling=sampling, query_starts=query_starts,
        verify=verify,
    )
