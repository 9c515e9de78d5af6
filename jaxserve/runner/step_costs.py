"""Measured step costs of the mixed buckets: what the step budget (`core/step_budget.py`) weighs.

After warm-up, when the engine has a latency target (``max_itl_ms``), it times each mixed bucket's executable
on synthetic rows: decode rows of one token and one prefill chunk with the rest of the bucket's tokens, every
row attending ``PROBE_CONTEXT`` cached tokens (fewer when the bucket is narrower). Each bucket runs once
untimed and then ``PROBE_RUNS`` times; the median is its cost. The rows use no sampler slot and write their
K/V into block 0, which no sequence holds yet (nothing is served before warm-up ends) and which a sequence
writes before it reads.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from jaxserve.core.buckets import MixedBucket
from jaxserve.core.step_budget import StepCosts
from jaxserve.runner.input_batch import StepInputs, step_shape
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.sampler import SamplingTensors
from jaxserve.runner.spec_verify import VerifyInputs

PROBE_CONTEXT = 512  # cached tokens each synthetic row attends to
PROBE_RUNS = 3


def measure_mixed_costs(runner: ModelRunner, buckets: list[MixedBucket]) -> StepCosts:
    """Median seconds per step of each mixed bucket shape (the narrowest context bucket of each)."""
    narrowest: dict[tuple[int, int], MixedBucket] = {}
    for bucket in sorted(buckets, key=lambda b: b.context_len, reverse=True):
        narrowest[(bucket.num_tokens, bucket.batch_size)] = bucket
    return StepCosts({key: _median_seconds(runner, bucket) for key, bucket in sorted(narrowest.items())})


def _median_seconds(runner: ModelRunner, bucket: MixedBucket) -> float:
    return median_step_seconds(runner, bucket, probe_inputs(runner, bucket))


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
        block_tables=np.zeros((shape.batch_size, shape.pages_per_seq), np.int32),
        q_start=q_start, lengths=lengths, sample_index=sample_index, sampling=sampling, query_starts=query_starts,
        verify=verify,
    )
