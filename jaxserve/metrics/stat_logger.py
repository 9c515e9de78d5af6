"""The periodic stats line of a serving engine (vLLM's LoggingStatLogger).

``LLMEngine.step()`` calls ``StatLogger.maybe_log()``; every ``interval`` seconds it logs, over the
interval: prompt tokens computed per second (prefix cache hits are not computed), generated tokens per
second, running and waiting requests, KV cache usage and the prefix cache hit rate (hit tokens over
looked-up tokens of the sequences admitted in the interval). Off with ``disable_log_stats``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from jaxserve.logger import init_logger

if TYPE_CHECKING:
    from jaxserve.engine.llm_engine import LLMEngine

logger = init_logger("jaxserve.stats")

DEFAULT_LOG_STATS_INTERVAL = 10.0  # seconds, vLLM's VLLM_LOG_STATS_INTERVAL


class StatLogger:
    def __init__(self, engine: LLMEngine, interval: float = DEFAULT_LOG_STATS_INTERVAL,
                 clock=time.monotonic) -> None:
        self.engine = engine
        self.interval = interval
        self.clock = clock
        self.last_time = clock()
        self.last = self._counters()

    def _counters(self) -> tuple[int, int, int, int]:
        stats = self.engine.stats
        return (stats.num_prefill_tokens, stats.num_generation_tokens, stats.prefix_cache_queries,
                stats.prefix_cache_hits)

    def maybe_log(self) -> str | None:
        """Logs (and returns) the stats line when ``interval`` has passed since the last one."""
        now = self.clock()
        elapsed = now - self.last_time
        if elapsed < self.interval:
            return None
        counters = self._counters()
        prefill, generated, queries, hits = (new - old for new, old in zip(counters, self.last, strict=True))
        self.last, self.last_time = counters, now
        scheduler = self.engine.scheduler
        line = (
            f"Avg prompt throughput: {prefill / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {generated / elapsed:.1f} tokens/s, "
            f"Running: {scheduler.num_running_requests} reqs, "
            f"Waiting: {scheduler.num_waiting_requests} reqs, "
            f"KV cache usage: {self.engine.block_manager.usage:.1%}, "
            f"Prefix cache hit rate: {hits / queries if queries else 0.0:.1%}"
        )
        logger.info("%s", line)
        return line
