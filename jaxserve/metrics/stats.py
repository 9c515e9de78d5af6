"""What the engine reports, as plain values: its counters since start and the scheduler's state at one moment.

Place in the data flow: `LLMEngine` keeps an `EngineStats` and bumps its counters as it steps;
`LLMEngine.make_stats()` copies them into a `StatsSnapshot` together with a `SchedulerStats` (requests
running and waiting, KV cache usage, the prefix cache's counters). The periodic stats line
(`stat_logger.py`) and the Prometheus collector (`prometheus.py`) read snapshots only, never the engine
(vLLM's `record(scheduler_stats, iteration_stats)`).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine started: what the benchmarks, the stats line and /metrics read."""

    num_steps: int = 0
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    num_mixed_steps: int = 0  # decode rows and prefill chunks in one step
    num_real_tokens: int = 0  # query tokens of the steps' rows
    num_padded_tokens: int = 0  # query slots run only to fill the steps' buckets
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_prefill_tokens: int = 0  # prompt (and recomputed) tokens run through the model: cache hits excluded
    num_generation_tokens: int = 0
    num_compiles_after_warm_up: int = 0  # executables built while serving: should stay 0
    num_buckets: int = 0  # the bucket grid's executables (set when a snapshot is taken)
    num_buckets_ready: int = 0  # of which steps may select now (the rest build in the background)
    num_late_sampled_steps: int = 0  # steps sampled after dispatch, once their rows' grammar masks were known
    num_late_masks: int = 0  # constrained rows of those steps whose mask was filled after dispatch
    # speculative decoding (vLLM's spec_decode counters): rows verified with drafts, their drafts, those accepted,
    # and accepted drafts by position in the row
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def count_drafts(self, num_drafts: int, num_accepted: int) -> None:
        """One verified row: ``num_drafts`` drafts, the first ``num_accepted`` accepted."""
        if not num_drafts:
            return
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += num_drafts
        self.num_spec_accepted_tokens += num_accepted
        missing = num_drafts - len(self.spec_accepted_per_position)
        self.spec_accepted_per_position.extend([0] * max(missing, 0))
        for position in range(num_accepted):
            self.spec_accepted_per_position[position] += 1

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted drafts per draft (0 without any)."""
        return self.num_spec_accepted_tokens / max(self.num_spec_draft_tokens, 1)

    @property
    def padding_per_real_token(self) -> float:
        """Padded query slots per real query token, over all steps (a bucket's own share of padding is
        `core.buckets.padding_waste`)."""
        return self.num_padded_tokens / max(self.num_real_tokens, 1)


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """The scheduler at one moment (vLLM's SchedulerStats)."""

    num_running_reqs: int = 0  # requests, not sequences (n > 1 and beams run several)
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of the KV pool's blocks in use
    prefix_cache_queries: int = 0  # tokens of admitted sequences looked up in the prefix cache, so far
    prefix_cache_hits: int = 0  # of those, tokens found cached


@dataclasses.dataclass(frozen=True)
class StatsSnapshot:
    """The engine's counters and its scheduler's state, copied at one moment."""

    scheduler: SchedulerStats
    engine: EngineStats


def combined(snapshots: list[StatsSnapshot]) -> StatsSnapshot:
    """Several engines' snapshots as one (data-parallel replicas): counters and request counts add up, lists add up
    position by position, KV cache usage is the mean (the replicas' pools are alike)."""
    return StatsSnapshot(
        SchedulerStats(**_summed([s.scheduler for s in snapshots]),
                       kv_cache_usage=sum(s.scheduler.kv_cache_usage for s in snapshots) / len(snapshots)),
        EngineStats(**_summed([s.engine for s in snapshots])),
    )


def _summed(stats: list) -> dict:
    totals = {}
    for field in dataclasses.fields(stats[0]):
        values = [getattr(s, field.name) for s in stats]
        if field.name == "kv_cache_usage":
            continue
        if isinstance(values[0], list):
            width = max(len(v) for v in values)
            totals[field.name] = [sum(v[i] for v in values if i < len(v)) for i in range(width)]
        else:
            totals[field.name] = sum(values)
    return totals
