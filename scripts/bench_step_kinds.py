"""Device time of one step of each bucket, decode against mixed, with and without speculation's sample positions.

Builds the engine twice on ``MODEL`` with ``BUCKETS`` (bfloat16; without, then with n-gram speculation, K = 4) and
times each decode bucket (every row at 300 cached tokens) and each mixed bucket (decode rows and a chunk,
`runner/step_costs.py`'s `probe_inputs`) through `ModelRunner.execute`, 30 runs after one untimed: the median
milliseconds, the host's dispatch included, no engine loop. It separates what a step kind costs on the device from
the engine's host work (scripts/bench_draft_bounds.py measures both together).

    python scripts/bench_step_kinds.py MODEL BUCKETS      # e.g. a random SmolLM2 shape on a GPU
"""

from __future__ import annotations

import sys

import numpy as np

from jaxserve import LLM
from jaxserve.runner.input_batch import StepInputs, step_shape, tables_of_every_group
from jaxserve.runner.sampler import SamplingTensors
from jaxserve.runner.step_costs import median_step_seconds, probe_inputs


def timed(runner, bucket, inputs) -> float:
    """Median milliseconds of one step (`runner/step_costs.py`'s timing, 30 runs)."""
    return 1e3 * median_step_seconds(runner, bucket, inputs, runs=30)


def decode_inputs(runner, bucket):
    shape = step_shape(bucket, runner.block_size)
    s = shape.batch_size
    z = np.zeros(s, np.int32)
    lengths = np.full(s, 300, np.int32)
    tables = tables_of_every_group(np.zeros((s, shape.pages_per_seq), np.int32), runner.num_kv_groups)
    return StepInputs(np.zeros((s, 1), np.int32), tables, lengths - 1, lengths,
                      z, SamplingTensors.from_rows([], s, runner.num_sampler_slots, runner.config.vocab_size))


def main() -> None:
    model, buckets = sys.argv[1], sys.argv[2]
    common = {"dtype": "bfloat16", "buckets": buckets, "max_model_len": 1024, "num_kv_blocks": 4096}
    speculative = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}
    for name, kwargs in (("plain", {}), ("spec", speculative)):
        llm = LLM(model, **common, **kwargs)
        runner, grid = llm.llm_engine.runner, llm.llm_engine.grid
        for b in grid.decode_buckets:
            print(name, "decode rows", b.batch_size, f"{timed(runner, b, decode_inputs(runner, b)):.2f} ms", flush=True)
        for b in grid.mixed_buckets:
            print(name, "mixed rows", b.batch_size, "tokens", b.num_tokens, "sample positions", b.num_sample_positions,
                  f"{timed(runner, b, probe_inputs(runner, b)):.2f} ms", flush=True)
        del llm


if __name__ == "__main__":
    main()
