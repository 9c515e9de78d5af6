"""Bucket planner: from a trace of request lengths and a budget of executables, the bucket file that
minimises expected padding (``scripts/plan_buckets.py`` is its command line).

Place in the data flow: offline, before `precompile`. Its output is a ``buckets/*.toml`` file that
``load_bucket_spec`` reads; batch sizes, ``block_size`` and the optional ``[mixed]`` table come from a
base spec unchanged (batch sizes follow concurrency, not lengths; mixed steps follow the token budget),
and the planner chooses the two length lists:

- ``[prefill] lengths`` (chunk buckets): every prompt runs as chunks of at most the largest chunk
  length (by default the longest prompt, so each prompt is one chunk); a chunk of ``n`` tokens is
  padded to the smallest chunk length ``>= n``.
- ``[context] lengths`` (multiples of ``block_size``): every step of a sequence attends to the smallest
  context length ``>= `` its context: after a prefill chunk, the chunk's end; on the decode step that
  samples output token ``j >= 2``, ``prompt_len + j - 1``. The largest covers ``prompt_len +
  output_len`` of every request (the engine's admission limit).

Expected padding is measured one sequence per step (batching adds rows and pads every row to the
batch's largest context; that depends on arrivals, not on these lists): ``prefill`` is the padded
share of chunk query tokens, ``context`` the padded share of attended context tokens. The planner
minimises their sum. For ``k`` chunk lengths (or ``m`` context lengths) the optimal set is a weighted
one-dimensional ``k``-quantisation solved exactly by dynamic programming over the observed lengths
(an optimal bucket boundary always sits on an observed length, rounded up to the alignment). Every
``(k, m)`` whose exact pruned grid (`BucketGrid`, mixed buckets included) fits the budget is scored;
the best is kept. The baseline is the best power-of-two ladder under the same budget; the plan is
never worse than it.

No JAX here.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from jaxserve.core.buckets import BucketGrid, BucketSpec
from jaxserve.math_utils import round_up

# -- the trace --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    prompt_len: int
    output_len: int


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Requests of a jsonl trace: one ``{"prompt_len": int, "output_len": int, ...}`` object a line."""
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompt_len, output_len = item["prompt_len"], item["output_len"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}:{number}: expected a JSON object with prompt_len and output_len") from None
        for name, value in (("prompt_len", prompt_len), ("output_len", output_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{path}:{number}: {name} must be a positive integer, got {value!r}")
        requests.append(TraceRequest(prompt_len, output_len))
    if not requests:
        raise ValueError(f"{path}: the trace has no requests")
    return requests


@dataclasses.dataclass(frozen=True)
class LengthProfile:
    """How often each real length occurs: prefill chunks, and step contexts (prefill and decode)."""

    chunk_counts: dict[int, int]
    context_counts: dict[int, int]
    max_chunk_len: int
    max_total_len: int  # largest prompt_len + output_len: the largest context must cover it


def length_profile(trace: Sequence[TraceRequest], max_chunk_len: int) -> LengthProfile:
    chunks: dict[int, int] = {}
    contexts: dict[int, int] = {}
    max_total = max(r.prompt_len + r.output_len for r in trace)
    decode_steps = np.zeros(max_total + 2, np.int64)  # difference array: +1 at a run's start, -1 past its end
    for r in trace:
        for start in range(0, r.prompt_len, max_chunk_len):
            end = min(start + max_chunk_len, r.prompt_len)
            chunks[end - start] = chunks.get(end - start, 0) + 1
            contexts[end] = contexts.get(end, 0) + 1
        if r.output_len > 1:  # decode contexts prompt_len + 1 .. prompt_len + output_len - 1
            decode_steps[r.prompt_len + 1] += 1
            decode_steps[r.prompt_len + r.output_len] -= 1
    for context, count in enumerate(np.cumsum(decode_steps)):
        if count:
            contexts[context] = contexts.get(context, 0) + int(count)
    return LengthProfile(chunks, contexts, max(chunks), max_total)


# -- padding of one length list ---------------------------------------------------------------------


def padded_total(counts: dict[int, int], boundaries: Sequence[int]) -> tuple[int, int]:
    """(real, padded) totals when every length is padded to the smallest boundary ``>=`` it."""
    bounds = np.asarray(sorted(boundaries))
    values = np.asarray(list(counts))
    weights = np.asarray(list(counts.values()))
    index = np.searchsorted(bounds, values)  # first boundary >= value
    if (index >= len(bounds)).any():
        raise ValueError(f"length {values[index >= len(bounds)].max()} exceeds the largest boundary {bounds[-1]}")
    return int((weights * values).sum()), int((weights * bounds[index]).sum())


def waste(counts: dict[int, int], boundaries: Sequence[int]) -> float:
    real, padded = padded_total(counts, boundaries)
    return (padded - real) / padded


def optimal_boundaries(counts: dict[int, int], multiple: int, max_boundaries: int) -> list[list[int]]:
    """For k = 1..max_boundaries, the k boundaries (multiples of ``multiple``, the largest covering every
    length) with the least padding. Index ``k - 1`` of the result; fewer if there are fewer candidates.

    Dynamic programming over the candidate boundaries c_1 < ... < c_n (observed lengths rounded up):
    ``best[k][j]`` is the least padding of every length up to c_j with k boundaries, the last at c_j.
    """
    rounded: dict[int, list[int]] = {}
    for value, weight in counts.items():
        rounded.setdefault(round_up(value, multiple), [0, 0])
        rounded[round_up(value, multiple)][0] += weight
        rounded[round_up(value, multiple)][1] += weight * value
    cands = np.asarray(sorted(rounded), np.int64)
    n = len(cands)
    weight_prefix = np.concatenate([[0], np.cumsum([rounded[c][0] for c in cands])])
    value_prefix = np.concatenate([[0], np.cumsum([rounded[c][1] for c in cands])])

    def cost(i: np.ndarray, j: int) -> np.ndarray:  # lengths in (c_{i-1}, c_j] padded to c_j (1-based i)
        return cands[j - 1] * (weight_prefix[j] - weight_prefix[i - 1]) - (value_prefix[j] - value_prefix[i - 1])

    best = np.full((min(max_boundaries, n) + 1, n + 1), np.iinfo(np.int64).max // 4, np.int64)
    choice = np.zeros_like(best)
    best[0, 0] = 0
    for k in range(1, best.shape[0]):
        for j in range(k, n + 1):
            starts = np.arange(k, j + 1)  # the previous boundary is c_{start-1}
            totals = best[k - 1, starts - 1] + cost(starts, j)
            pick = int(np.argmin(totals))
            best[k, j], choice[k, j] = totals[pick], starts[pick] - 1
    plans = []
    for k in range(1, best.shape[0]):
        bounds, j = [], n
        for kk in range(k, 0, -1):
            bounds.append(int(cands[j - 1]))
            j = int(choice[kk, j])
        plans.append(sorted(bounds))
    return plans


def power_of_two_ladders(max_length: int, base: int) -> list[list[int]]:
    """``base * 2**i`` up to the first that covers ``max_length``; index ``k - 1``: its top k rungs."""
    ladder = [base]
    while ladder[-1] < max_length:
        ladder.append(ladder[-1] * 2)
    return [ladder[-k:] for k in range(1, len(ladder) + 1)]


# -- planning ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One bucket file: its spec, executable count and expected padding."""

    spec: BucketSpec
    num_executables: int
    prefill_waste: float
    context_waste: float

    def objective(self, context_weight: float = 1.0) -> float:
        return self.prefill_waste + context_weight * self.context_waste


@dataclasses.dataclass(frozen=True)
class Plan:
    planned: Candidate
    power_of_two: Candidate | None  # None when no power-of-two ladder fits the budget
    trace_source: str
    num_requests: int
    budget: int

    def to_toml(self) -> str:
        spec, p = self.planned.spec, self.planned
        lines = [
            f"# Planned by scripts/plan_buckets.py from {self.trace_source} ({self.num_requests} requests) for a "
            f"budget of {self.budget} executables ({p.num_executables} used).",
            f"# Expected padding, one sequence per step: prefill {p.prefill_waste:.1%} of chunk tokens, context "
            f"{p.context_waste:.1%} of attended tokens.",
        ]
        if self.power_of_two is not None:
            b = self.power_of_two
            lines.append(
                f"# Power-of-two buckets under the same budget: prefill {b.prefill_waste:.1%}, context "
                f"{b.context_waste:.1%} ({b.num_executables} executables)."
            )
        fmt = lambda values: "[" + ", ".join(map(str, values)) + "]"
        lines += [
            f"block_size = {spec.block_size}",
            "",
            "[decode]",
            f"batch_sizes = {fmt(spec.decode_batch_sizes)}",
            "",
            "[prefill]",
            f"batch_sizes = {fmt(spec.prefill_batch_sizes)}",
            f"lengths = {fmt(spec.prefill_lengths)}",
            "",
            "[context]",
            f"lengths = {fmt(spec.context_lengths)}",
            "",
        ]
        if spec.mixed_batch_sizes:
            lines += [
                "[mixed]",
                f"batch_sizes = {fmt(spec.mixed_batch_sizes)}",
                f"token_counts = {fmt(spec.mixed_token_counts)}",
                "",
            ]
        return "\n".join(lines)

    def format_table(self) -> str:
        rows = [("planned", self.planned)] + ([("power of two", self.power_of_two)] if self.power_of_two else [])
        cells = [
            (name, str(list(c.spec.prefill_lengths)), str(list(c.spec.context_lengths)), str(c.num_executables),
             f"{c.prefill_waste:.1%}", f"{c.context_waste:.1%}")
            for name, c in rows
        ]
        headers = ("buckets", "prefill lengths", "context lengths", "executables", "prefill padding",
                   "context padding")
        widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
        line = lambda row: "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        return "\n".join([line(headers), *map(line, cells)])


@dataclasses.dataclass(frozen=True)
class _Limits:
    max_num_seqs: int
    num_kv_blocks: int | None
    budget: int
    context_weight: float


def _candidate(base: BucketSpec, chunks: list[int], contexts: list[int], profile: LengthProfile,
               limits: _Limits, source: str) -> Candidate:
    spec = BucketSpec(
        decode_batch_sizes=base.decode_batch_sizes, prefill_batch_sizes=base.prefill_batch_sizes,
        prefill_lengths=tuple(chunks), context_lengths=tuple(contexts), block_size=base.block_size,
        mixed_batch_sizes=base.mixed_batch_sizes, mixed_token_counts=base.mixed_token_counts, source=source,
    )
    num_blocks = limits.num_kv_blocks or limits.max_num_seqs * (contexts[-1] // base.block_size)
    grid = BucketGrid(
        spec, block_size=base.block_size, max_model_len=contexts[-1], max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=max(base.prefill_batch_sizes) * chunks[-1], num_blocks=num_blocks,
    )
    return Candidate(
        spec, grid.num_executables, waste(profile.chunk_counts, chunks), waste(profile.context_counts, contexts)
    )


def _best_within_budget(base: BucketSpec, chunk_sets: list[list[int]], context_sets: list[list[int]],
                        profile: LengthProfile, limits: _Limits, source: str) -> Candidate | None:
    best, weight = None, limits.context_weight
    for chunks in chunk_sets:
        if len(base.prefill_batch_sizes) * len(chunks) > limits.budget:  # each chunk length keeps >= 1 context
            break
        for contexts in context_sets:
            if len(base.decode_batch_sizes) * len(contexts) > limits.budget:  # no decode bucket is pruned here
                break
            candidate = _candidate(base, chunks, contexts, profile, limits, source)
            if candidate.num_executables <= limits.budget and (
                best is None or candidate.objective(weight) < best.objective(weight)
            ):
                best = candidate
    return best


def plan_buckets(
    trace: Sequence[TraceRequest],
    budget: int,
    base: BucketSpec,
    *,
    chunk_multiple: int = 1,
    max_chunk_len: int | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    num_kv_blocks: int | None = None,
    context_weight: float = 1.0,
    trace_source: str = "<trace>",
    output_source: str = "<planned>",
) -> Plan:
    """The bucket file with the least expected padding whose grid has at most ``budget`` executables.

    ``max_model_len`` (default: the trace's longest request) is what the largest context bucket must
    hold. ``max_num_seqs`` (default: the base's largest decode batch) and ``num_kv_blocks`` (default: a
    pool that prunes nothing, so the engine's grid never has more executables than counted here) are
    the engine limits the grid is pruned with. The objective is ``prefill padding + context_weight *
    context padding``.
    """
    for name, value in (("budget", budget), ("chunk_multiple", chunk_multiple)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if base.block_size is None:
        raise ValueError(f"{base.source}: the base spec needs a block_size")
    if max_chunk_len is not None and (max_chunk_len < 1 or max_chunk_len % chunk_multiple):
        raise ValueError(f"max_chunk_len must be a positive multiple of chunk_multiple ({chunk_multiple}), "
                         f"got {max_chunk_len}")
    if not context_weight >= 0:
        raise ValueError(f"context_weight must be >= 0, got {context_weight}")
    profile = length_profile(trace, max_chunk_len or max(r.prompt_len for r in trace))
    longest = max(profile.max_total_len, max_model_len or 0)
    context_counts = {**profile.context_counts, longest: profile.context_counts.get(longest, 0)}  # top bucket
    limits = _Limits(max_num_seqs or max(base.decode_batch_sizes), num_kv_blocks, budget, context_weight)
    planned = _best_within_budget(
        base,
        optimal_boundaries(profile.chunk_counts, chunk_multiple, budget // len(base.prefill_batch_sizes)),
        optimal_boundaries(context_counts, base.block_size, budget // len(base.decode_batch_sizes)),
        profile, limits, output_source,
    )
    if planned is None:
        smallest = _candidate(base, [round_up(profile.max_chunk_len, chunk_multiple)],
                              [round_up(longest, base.block_size)], profile, limits, output_source)
        raise ValueError(
            f"budget {budget} is below the smallest grid: one chunk length and one context length already "
            f"make {smallest.num_executables} executables with the batch sizes of {base.source}"
        )
    ladder_base = chunk_multiple if chunk_multiple & (chunk_multiple - 1) == 0 else 1
    baseline = _best_within_budget(
        base, power_of_two_ladders(profile.max_chunk_len, ladder_base),
        power_of_two_ladders(longest, base.block_size), profile, limits, output_source,
    )
    if baseline is not None and baseline.objective(context_weight) < planned.objective(context_weight):
        planned = baseline  # only when pruning let the ladder fit where the optimal sets did not
    return Plan(planned, baseline, trace_source, len(trace), budget)


def describe_trace(trace: Iterable[TraceRequest]) -> str:
    trace = list(trace)
    prompts = [r.prompt_len for r in trace]
    totals = [r.prompt_len + r.output_len for r in trace]
    return (f"{len(trace)} requests: prompt_len {min(prompts)}..{max(prompts)}, "
            f"prompt_len + output_len {min(totals)}..{max(totals)}")
