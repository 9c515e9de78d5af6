"""Background compilation: the grid's executables beyond the covering set, built in a thread while the engine serves.

Place in the data flow: the engine's warm-up (`engine/engine_builder.py`) compiles the covering set
(`BucketGrid.covering_buckets`: every admissible step has one of them that holds it, padded if need be), lets the
grid serve only those (`BucketGrid.serve_only`) and hands the other buckets to a `BackgroundCompiler`. Its thread
builds them one at a time, each with its sampler (`compilation/warm_up.py`'s `compile_bucket`), from the compile
cache where it has them. The order follows traffic: the bucket that steps wanted most often while it was missing
(`BucketGrid.on_miss` calls `wanted`) comes next, then the grid's own order (prefill, decode, mixed, smallest
first). A built bucket waits in a queue until `LLMEngine.step` has it marked ready in the grid (`hand_over`) before
it schedules: the step after an executable lands may use it, and no step waits on a compile nor
compiles anything itself (the strict mode's per-thread check still holds on the step's thread).

The thread runs at a lower scheduling priority (nice +10, Linux threads have their own) so that serving keeps the
cores it needs; XLA's compiler threads inherit it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from jaxserve.compilation.compile_cache import thread_compile_counts
from jaxserve.core.buckets import Bucket, BucketGrid
from jaxserve.logger import init_logger

logger = init_logger("jaxserve.compilation.background")

BACKGROUND_NICENESS = 10


class BackgroundCompiler:
    """Builds ``buckets`` with ``build`` (one bucket's executables) in a daemon thread, most wanted first."""

    def __init__(self, build: Callable[[Bucket], None], buckets: Sequence[Bucket], *, grid: BucketGrid | None = None,
                 on_done=None) -> None:
        """``grid``: where `hand_over` marks the built buckets ready. ``on_done(seconds)``: called in the thread once
        every bucket is built (not after `stop`). With no buckets it is never started and hands nothing over."""
        self._build = build
        self.grid = grid
        self._pending = list(buckets)
        self._wanted: Counter[Bucket] = Counter()
        self._ready: queue.SimpleQueue[Bucket] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._on_done = on_done
        self.error: BaseException | None = None
        self.num_built = 0
        self.backend_compiles = 0  # XLA compilations in this thread: not the step path's (`LLMEngine.serving_compiles`)
        self.started: float | None = None  # time.perf_counter() at `start`
        self._thread = threading.Thread(target=self._run, name="jaxserve-background-compile", daemon=True)

    def start(self) -> BackgroundCompiler:
        self.started = time.perf_counter()
        self._thread.start()
        return self

    def wanted(self, bucket: Bucket) -> None:
        """A step would have run on ``bucket`` had it been built: it moves up the queue."""
        with self._lock:
            self._wanted[bucket] += 1

    def take_ready(self) -> list[Bucket]:
        """The buckets built since the last call (the engine marks them ready between steps)."""
        built = []
        while True:
            try:
                built.append(self._ready.get_nowait())
            except queue.Empty:
                return built

    def hand_over(self) -> None:
        """Marks the buckets built since the last call ready in the grid: the engine calls it between steps."""
        if self.grid is not None and not self.grid.is_complete:
            self.grid.mark_ready(self.take_ready())

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits up to ``timeout`` for every bucket to be built, then hands them over (call it where the engine steps,
        between steps); whether every bucket of the grid serves now (without a grid: whether the thread ended)."""
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.hand_over()
        return not self._thread.is_alive() if self.grid is None else self.grid.is_complete

    def stop(self, timeout: float | None = None) -> None:
        """No further bucket is started; waits up to ``timeout`` for the one being built."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _next(self) -> Bucket | None:
        with self._lock:
            if not self._pending or self._stop.is_set():
                return None
            best = max(range(len(self._pending)), key=lambda i: (self._wanted[self._pending[i]], -i))
            return self._pending.pop(best)

    def _run(self) -> None:
        _lower_thread_priority()
        before = thread_compile_counts()
        try:
            while (bucket := self._next()) is not None:
                self._build(bucket)
                self.num_built += 1
                self.backend_compiles = (thread_compile_counts() - before).backend_compiles
                self._ready.put(bucket)
        except BaseException as e:  # logged here and kept in `error`; the buckets built so far keep serving
            self.error = e
            logger.exception("background compilation stopped: the grid keeps serving the buckets built so far")
            return
        if not self._stop.is_set() and self._on_done is not None:
            self._on_done(time.perf_counter() - self.started)


def _lower_thread_priority() -> None:
    """nice +10 for the calling thread only (Linux: a thread is a task with its own niceness)."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError):  # not permitted: the thread runs at the process's priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)
