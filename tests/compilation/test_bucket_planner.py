"""The bucket planner: its file covers every length of the trace, fits the budget, loads as a bucket spec,
and pads no more than power-of-two buckets; the dynamic programme is exact (checked by brute force)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from jaxserve.compilation.bucket_planner import (
    TraceRequest,
    length_profile,
    optimal_boundaries,
    padded_total,
    plan_buckets,
    power_of_two_ladders,
    read_trace,
)
from jaxserve.core.buckets import BucketGrid, BucketSpec, load_bucket_spec
from tests.paths import REPO_ROOT, SHARED_WORKLOADS

WORKLOAD = SHARED_WORKLOADS / "mixed_lengths.jsonl"
# A fixed base (batch sizes, block size), so the expected plans do not move when buckets/cpu.toml does.
BASE_TOML = """
block_size = 16
[decode]
batch_sizes = [1, 2, 4, 8, 16]
[prefill]
batch_sizes = [1]
lengths = [512]
[context]
lengths = [2048]
"""
CPU = BucketSpec.from_toml_text(BASE_TOML, source="base.toml")


def _simulated_padding(trace: list[TraceRequest], chunks: list[int], contexts: list[int], max_chunk: int):
    """Independent oracle: walk every request step by step; (prefill, context) padded fractions."""
    fit = lambda buckets, n: min(b for b in buckets if b >= n)
    real_q = padded_q = real_c = padded_c = 0
    for r in trace:
        done = 0
        while done < r.prompt_len:
            n = min(max_chunk, r.prompt_len - done)
            done += n
            real_q, padded_q = real_q + n, padded_q + fit(chunks, n)
            real_c, padded_c = real_c + done, padded_c + fit(contexts, done)
        for j in range(2, r.output_len + 1):  # the step that samples output token j
            context = r.prompt_len + j - 1
            real_c, padded_c = real_c + context, padded_c + fit(contexts, context)
    return (padded_q - real_q) / padded_q, (padded_c - real_c) / padded_c


def _engine_grid(spec: BucketSpec, num_blocks: int = 1024) -> BucketGrid:
    """The grid LLMEngine derives from a bucket file on CPU (its default limits)."""
    return BucketGrid(
        spec, block_size=spec.block_size, max_model_len=spec.context_lengths[-1],
        max_num_seqs=max(spec.decode_batch_sizes),
        max_num_batched_tokens=max(spec.prefill_batch_sizes) * max(spec.prefill_lengths), num_blocks=num_blocks,
    )


def test_planned_file_for_the_shared_trace_covers_it_fits_the_budget_and_beats_powers_of_two(tmp_path):
    out, base = tmp_path / "planned.toml", tmp_path / "base.toml"
    base.write_text(BASE_TOML)
    result = subprocess.run(
        [sys.executable, "scripts/plan_buckets.py", str(WORKLOAD), "--budget", "24", "--out", str(out),
         "--base", str(base)],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=120,
    )
    trace = read_trace(WORKLOAD)
    spec = load_bucket_spec(str(out))
    assert spec.prefill_lengths == (50, 95, 164, 217, 301, 400, 700, 873)
    assert spec.context_lengths == (368, 1056)
    assert (spec.decode_batch_sizes, spec.prefill_batch_sizes, spec.block_size) == ((1, 2, 4, 8, 16), (1,), 16)
    # Covers: every prompt is one chunk, every request fits the largest context (the engine's limit).
    assert all(r.prompt_len <= spec.prefill_lengths[-1] for r in trace)
    assert all(r.prompt_len + r.output_len <= spec.context_lengths[-1] for r in trace)
    grid = _engine_grid(spec)
    assert grid.num_executables == 24
    for r in trace:
        grid.check_request(r.prompt_len, r.output_len)
        grid.select_prefill(1, r.prompt_len, r.prompt_len)
        grid.select_decode(1, r.prompt_len + r.output_len)
    planned = _simulated_padding(trace, list(spec.prefill_lengths), list(spec.context_lengths), 873)
    powers = _simulated_padding(trace, [16, 32, 64, 128, 256, 512, 1024], [1024, 2048], 1024)
    assert planned[0] < powers[0] and planned[1] < powers[1]
    assert _engine_grid(BucketSpec((1, 2, 4, 8, 16), (1,), (16, 32, 64, 128, 256, 512, 1024), (1024, 2048), 16))\
        .num_executables == 24  # the baseline it printed has the same budget
    table = result.stdout.splitlines()
    planned_row = next(line for line in table if line.startswith("planned"))
    powers_row = next(line for line in table if line.startswith("power of two"))
    assert planned_row.split()[-3:] == ["24", f"{planned[0]:.1%}", f"{planned[1]:.1%}"]
    assert powers_row.split()[-3:] == ["24", f"{powers[0]:.1%}", f"{powers[1]:.1%}"]
    assert out.read_text().startswith("# Planned by scripts/plan_buckets.py from mixed_lengths.jsonl (256 requests)")


def _random_trace(rng: np.random.Generator, n: int) -> list[TraceRequest]:
    prompts = np.clip(rng.lognormal(4.5, 0.9, n), 1, 3000).astype(int)
    outputs = np.clip(rng.lognormal(4.5, 0.8, n), 1, 1500).astype(int)
    return [TraceRequest(int(p), int(o)) for p, o in zip(prompts, outputs, strict=True)]


@pytest.mark.parametrize("seed", range(8))
def test_plan_covers_every_length_and_pads_no_more_than_powers_of_two(seed):
    rng = np.random.default_rng(seed)
    trace = _random_trace(rng, 120)
    budget = int(rng.choice([10, 16, 24, 40]))
    base = CPU if seed % 2 else BucketSpec((1, 4, 16), (1, 4), (128,), (512,), 16, source="base")
    plan = plan_buckets(trace, budget, base, chunk_multiple=int(rng.choice([1, 8])))
    spec = plan.planned.spec
    assert plan.planned.num_executables == _engine_grid(spec, num_blocks=10**6).num_executables <= budget
    assert all(r.prompt_len <= spec.prefill_lengths[-1] for r in trace)
    assert all(r.prompt_len + r.output_len <= spec.context_lengths[-1] for r in trace)
    assert all(c % 16 == 0 for c in spec.context_lengths)
    oracle = _simulated_padding(trace, list(spec.prefill_lengths), list(spec.context_lengths),
                                max(r.prompt_len for r in trace))
    assert (plan.planned.prefill_waste, plan.planned.context_waste) == pytest.approx(oracle, abs=1e-12)
    assert plan.power_of_two is not None and plan.power_of_two.num_executables <= budget
    assert plan.planned.objective() <= plan.power_of_two.objective()
    assert BucketSpec.from_toml_text(plan.to_toml()) == spec  # the written file reads back


def test_dynamic_programme_is_optimal_against_brute_force():
    rng = np.random.default_rng(7)
    for _ in range(30):
        values = rng.integers(1, 120, size=int(rng.integers(3, 12)))
        counts = {int(v): int(rng.integers(1, 9)) for v in values}
        multiple = int(rng.choice([1, 4, 16]))
        plans = optimal_boundaries(counts, multiple, 4)
        cands = sorted({-(-v // multiple) * multiple for v in counts})
        assert len(plans) == min(4, len(cands))
        for k, plan in enumerate(plans, start=1):
            assert len(plan) == k and plan[-1] == cands[-1] and all(b % multiple == 0 for b in plan)
            best = min(
                padded_total(counts, [*rest, cands[-1]])[1]
                for rest in itertools.combinations(cands[:-1], k - 1)
            )
            assert padded_total(counts, plan)[1] == best


def test_length_profile_counts_chunks_and_step_contexts():
    trace = [TraceRequest(3, 4), TraceRequest(600, 1)]
    profile = length_profile(trace, max_chunk_len=256)
    assert profile.chunk_counts == {3: 1, 256: 2, 88: 1}
    # request 1: prefill context 3, decode contexts 4, 5, 6; request 2: chunk ends 256, 512, 600, no decode
    assert profile.context_counts == {3: 1, 4: 1, 5: 1, 6: 1, 256: 1, 512: 1, 600: 1}
    assert (profile.max_chunk_len, profile.max_total_len) == (256, 601)
    plan = plan_buckets(trace, 40, CPU, max_chunk_len=256, max_model_len=2048)
    assert plan.planned.spec.prefill_lengths[-1] == 256 and plan.planned.spec.context_lengths[-1] == 2048


def test_power_of_two_ladders():
    assert power_of_two_ladders(1049, 16) == [[2048], [1024, 2048], [512, 1024, 2048], [256, 512, 1024, 2048],
                                              [128, 256, 512, 1024, 2048], [64, 128, 256, 512, 1024, 2048],
                                              [32, 64, 128, 256, 512, 1024, 2048],
                                              [16, 32, 64, 128, 256, 512, 1024, 2048]]
    assert power_of_two_ladders(16, 16) == [[16]]


def test_errors_are_clear(tmp_path):
    trace = [TraceRequest(10, 10)]
    with pytest.raises(ValueError, match=r"^budget 5 is below the smallest grid: one chunk length and one context "
                                         r"length already make 6 executables with the batch sizes of base.toml$"):
        plan_buckets(trace, 5, CPU)
    with pytest.raises(ValueError, match=r"^max_chunk_len must be a positive multiple of chunk_multiple \(8\), "
                                         r"got 100$"):
        plan_buckets(trace, 24, CPU, chunk_multiple=8, max_chunk_len=100)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_len": 5, "output_len": 2}) + "\n" + json.dumps({"prompt_len": 0}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object with prompt_len and output_len$"):
        read_trace(bad)
    bad.write_text(json.dumps({"prompt_len": 5, "output_len": 0}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: output_len must be a positive integer, got 0$"):
        read_trace(bad)


def test_plan_carries_the_base_mixed_table_and_counts_its_buckets():
    trace = [TraceRequest(100, 50), TraceRequest(300, 20), TraceRequest(40, 400), TraceRequest(700, 100)]
    mixed_base = BucketSpec.from_toml_text(
        BASE_TOML + "[mixed]\nbatch_sizes = [4, 16]\ntoken_counts = [64, 256]\n", source="base.toml"
    )
    plain = plan_buckets(trace, 24, CPU).planned
    assert (plain.spec.context_lengths, plain.num_executables) == ((208, 432, 800), 23)
    assert "[mixed]" not in plan_buckets(trace, 24, CPU).to_toml()
    plan = plan_buckets(trace, 24, mixed_base)
    spec = plan.planned.spec
    # the 8 mixed buckets count against the budget: one context length fewer than without them
    assert (spec.prefill_lengths, spec.context_lengths) == ((100, 300, 700), (384, 800))
    assert (spec.mixed_batch_sizes, spec.mixed_token_counts) == ((4, 16), (64, 256))
    grid = _engine_grid(spec, num_blocks=10**6)
    assert len(grid.mixed_buckets) == 8
    assert plan.planned.num_executables == grid.num_executables == 24
    text = plan.to_toml()
    assert text.endswith(
        "[context]\nlengths = [384, 800]\n\n[mixed]\nbatch_sizes = [4, 16]\ntoken_counts = [64, 256]\n"
    )
    assert BucketSpec.from_toml_text(text) == spec
