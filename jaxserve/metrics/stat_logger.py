"""The periodic stats line of a serving engine (vLLM's LoggingStatLogger).

`LLMEngine.step()` asks `StatLogger.is_due()`; every ``interval`` seconds it hands `log` a stats snapshot
(`stats.py`), which logs over the interval: prompt tokens computed per second (prefix cache hits are not
computed), generated tokens per second, running and waiting requests, KV cache usage and the prefix cache
hit rate (hit tokens over looked-up tokens of the sequences admitted in the interval), and with speculative
decoding the drafts' acceptance rate and mean acceptance length (tokens per verified row). Off with
``disable_log_stats``.
"""

from __future__ import annotations

import time

from jaxserve.logger import init_logger
from jaxserve.metrics.stats import StatsSnapshot

logger = init_logger("jaxserve.stats")

DEFAULT_LOG_STATS_INTERVAL = 10.0  # seconds, vLLM's VLLM_LOG_STATS_INTERVAL


def _counters(stats: StatsSnapshot) -> tuple[int, ...]:
    return (stats.engine.num_prefill_tokens, stats.engine.num_generation_tokens,
            stats.scheduler.prefix_cache_queries, stats.scheduler.prefix_cache_hits,
            stats.engine.num_spec_drafts, stats.engine.num_spec_draft_tokens, stats.engine.num_spec_accepted_tokens)


class StatLogger:
    def __init__(self, start: StatsSnapshot, interval: float = DEFAULT_LOG_STATS_INTERVAL,
                 clock=time.monotonic) -> None:
        """``start``: the engine's stats when logging starts, the first interval's baseline."""
        self.interval = interval
        self.clock = clock
        self.last_time = clock()
        self.last = _counters(start)

    def is_due(self) -> bool:
        """Whether ``interval`` has passed since the last line."""
        return self.clock() - self.last_time >= self.interval

    def log(self, stats: StatsSnapshot) -> str:
        """Logs (and returns) the stats line over the interval that ends now, at ``stats``."""
        now = self.clock()
        elapsed = max(now - self.last_time, 1e-9)
        counters = _counters(stats)
        prefill, generated, queries, hits, drafts, draft_tokens, accepted = (
            new - old for new, old in zip(counters, self.last, strict=True))
        self.last, self.last_time = counters, now
        scheduler = stats.scheduler
        line = (
            f"Avg prompt throughput: {prefill / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {generated / elapsed:.1f} tokens/s, "
            f"Running: {scheduler.num_running_reqs} reqs, "
            f"Waiting: {scheduler.num_waiting_reqs} reqs, "
            f"KV cache usage: {scheduler.kv_cache_usage:.1%}, "
            f"Prefix cache hit rate: {hits / queries if queries else 0.0:.1%}"
        )
        if draft_tokens:  # vLLM's SpecDecoding line, folded into ours
            line += (f", Draft acceptance rate: {accepted / draft_tokens:.1%}, Mean acceptance length: "
                     f"{1 + accepted / drafts:.2f}, Drafted tokens: {draft_tokens}, Accepted tokens: {accepted}")
        logger.info("%s", line)
        return line
