"""Prometheus metrics of a serving engine, with vLLM's names under a `jaxserve:` prefix.

Two sources feed one `CollectorRegistry` per server (so two apps in one process never collide):
- the engine's stats snapshot (`stats.py`) taken at scrape time (`EngineStateCollector`): requests running
  and waiting, KV cache usage, prompt and generation token counters, preemptions, compiles after warm-up,
  bucket padding, the bucket grid's executables and how many of them serve yet;
- request timings observed as the AsyncLLMEngine delivers outputs (`ServingMetrics`): time to first
  token, inter-token latency, end-to-end latency and finished requests by reason.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.metrics.stats import StatsSnapshot
from jaxserve.outputs import RequestOutput

disable_created_metrics()  # no `_created` series next to every counter and histogram (as vLLM)

PREFIX = "jaxserve:"
FINISH_REASONS = ("stop", "length", "abort")
# vLLM's histogram buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class EngineStateCollector:
    """Reads a stats snapshot of the engine at scrape time; nothing to keep in sync with the step loop."""

    def __init__(self, make_stats: Callable[[], StatsSnapshot], compiles_now: Callable[[], int]):
        self.make_stats = make_stats
        self.compiles_now = compiles_now
        self.compiles_at_start = compiles_now()  # the engine is warm when the server is built

    def collect(self) -> Iterable:
        stats = self.make_stats()
        scheduler, engine = stats.scheduler, stats.engine
        yield _gauge("num_requests_running", "Number of requests in model execution batches.",
                     scheduler.num_running_reqs)
        yield _gauge("num_requests_waiting", "Number of requests waiting to be processed.", scheduler.num_waiting_reqs)
        yield _gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", scheduler.kv_cache_usage)
        yield _counter("prompt_tokens", "Number of prefill tokens processed.", engine.num_prompt_tokens)
        yield _counter("generation_tokens", "Number of generation tokens processed.", engine.num_generation_tokens)
        yield _counter("num_preemptions", "Cumulative number of preemptions from the engine.",
                       engine.num_preemptions)
        yield _counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                       scheduler.prefix_cache_queries)
        yield _counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                       scheduler.prefix_cache_hits)
        yield _counter("compiles_after_warmup", "XLA compilations since the server finished warm-up "
                       "(anything but 0 is a bug).", self.compiles_now() - self.compiles_at_start)
        yield _counter("bucket_real_tokens", "Real query tokens run in bucketed steps.", engine.num_real_tokens)
        yield _counter("bucket_padded_tokens", "Padding query slots run to fill buckets.", engine.num_padded_tokens)
        yield _gauge("bucket_padding_per_real_token", "Padded query slots per real token over all steps.",
                     engine.padding_per_real_token)
        yield _gauge("bucket_grid_buckets", "Bucket executables of the engine's grid.", engine.num_buckets)
        yield _gauge("bucket_grid_buckets_ready", "Bucket executables steps may run now (the grid is complete when "
                     "this equals bucket_grid_buckets; the others build in the background).", engine.num_buckets_ready)
        yield from _spec_decode_counters(engine)


def _spec_decode_counters(engine) -> Iterable:
    """vLLM's speculative decoding counters: verified rows with drafts, their drafts, the accepted ones, and the
    accepted ones by position in the row (label ``position``)."""
    yield _counter("spec_decode_num_drafts", "Number of spec decoding drafts.", engine.num_spec_drafts)
    yield _counter("spec_decode_num_draft_tokens", "Number of draft tokens.", engine.num_spec_draft_tokens)
    yield _counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.", engine.num_spec_accepted_tokens)
    per_position = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                       "Accepted tokens per draft position.", labels=["position"])
    for position, count in enumerate(engine.spec_accepted_per_position):
        per_position.add_metric([str(position)], count)
    yield per_position


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, documentation, value=value)


@dataclasses.dataclass
class _RequestTiming:
    arrival: float
    last_token: float | None = None
    num_tokens: int = 0


class ServingMetrics:
    """The server's registry. AsyncLLMEngine calls `request_arrived` and `outputs_delivered`."""

    def __init__(self, make_stats: Callable[[], StatsSnapshot], compiles_now: Callable[[], int]):
        self.registry = CollectorRegistry()
        self.registry.register(EngineStateCollector(make_stats, compiles_now))
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            buckets=ITL_BUCKETS, registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
            buckets=E2E_BUCKETS, registry=self.registry,
        )
        self.request_success = Counter(
            PREFIX + "request_success", "Count of finished requests by finish reason.",
            ["finished_reason"], registry=self.registry,
        )
        for reason in FINISH_REASONS:
            self.request_success.labels(finished_reason=reason)
        self._timings: dict[str, _RequestTiming] = {}

    def request_arrived(self, request_id: str) -> None:
        self._timings[request_id] = _RequestTiming(arrival=time.monotonic())

    def outputs_delivered(self, delivered: Iterable[tuple[str, RequestOutput | BaseException]]) -> None:
        now = time.monotonic()
        for request_id, item in delivered:
            timing = self._timings.get(request_id)
            if timing is None:
                continue
            if isinstance(item, BaseException):  # rejected by the engine: never ran
                del self._timings[request_id]
                continue
            self._observe_tokens(timing, item, now)
            if item.finished:
                self._observe_finished(timing, item, now)
                del self._timings[request_id]

    def _observe_tokens(self, timing: _RequestTiming, output: RequestOutput, now: float) -> None:
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        if num_tokens <= timing.num_tokens:
            return
        if timing.last_token is None:
            self.time_to_first_token.observe(now - timing.arrival)
        else:
            self.inter_token_latency.observe(now - timing.last_token)
        timing.last_token, timing.num_tokens = now, num_tokens

    def _observe_finished(self, timing: _RequestTiming, output: RequestOutput, now: float) -> None:
        reasons = [c.finish_reason for c in output.outputs if c.finish_reason]
        reason = "abort" if "abort" in reasons else (reasons[0] if reasons else "abort")
        self.request_success.labels(finished_reason=reason).inc()
        if reason != "abort":
            self.e2e_request_latency.observe(now - timing.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
