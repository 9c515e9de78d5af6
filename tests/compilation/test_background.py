"""The background compiler's order and hand-over, with a build function that records instead of compiling."""

from __future__ import annotations

import threading

from jaxserve.compilation.background import BackgroundCompiler
from jaxserve.core.buckets import DecodeBucket

BUCKETS = [DecodeBucket(b, 64) for b in (1, 2, 4, 8)]


class GatedBuild:
    """Builds one bucket each time the test opens the gate; records the order."""

    def __init__(self) -> None:
        self.order: list[DecodeBucket] = []
        self.gate = threading.Semaphore(0)
        self.started = threading.Semaphore(0)

    def __call__(self, bucket: DecodeBucket) -> None:
        self.started.release()
        self.gate.acquire()
        self.order.append(bucket)


def test_builds_the_most_wanted_bucket_next_and_hands_each_over_once():
    build, finished = GatedBuild(), []
    compiler = BackgroundCompiler(build, BUCKETS, on_done=finished.append).start()
    build.started.acquire()  # building BUCKETS[0], the grid's first
    compiler.wanted(BUCKETS[3])
    compiler.wanted(BUCKETS[2])
    compiler.wanted(BUCKETS[3])
    build.gate.release()
    build.started.acquire()
    assert compiler.take_ready() == [BUCKETS[0]]
    assert compiler.take_ready() == []
    for _ in range(3):
        build.gate.release()
    assert compiler.wait(10)
    assert build.order == [BUCKETS[0], BUCKETS[3], BUCKETS[2], BUCKETS[1]]
    assert compiler.take_ready() == [BUCKETS[3], BUCKETS[2], BUCKETS[1]]
    assert (compiler.num_built, compiler.num_pending, len(finished), compiler.error) == (4, 0, 1, None)


def test_stop_ends_after_the_bucket_being_built():
    build, finished = GatedBuild(), []
    compiler = BackgroundCompiler(build, BUCKETS, on_done=finished.append).start()
    build.started.acquire()
    threading.Timer(0.05, build.gate.release).start()
    compiler.stop(timeout=10)
    assert (build.order, compiler.take_ready(), compiler.num_pending, finished) == ([BUCKETS[0]], [BUCKETS[0]], 3, [])
    assert not compiler.running


def test_a_failed_build_stops_the_thread_and_keeps_what_was_built():
    def build(bucket):
        if bucket == BUCKETS[1]:
            raise RuntimeError("out of memory")

    compiler = BackgroundCompiler(build, BUCKETS).start()
    assert compiler.wait(10)
    assert compiler.take_ready() == [BUCKETS[0]]
    assert repr(compiler.error) == "RuntimeError('out of memory')"
    assert compiler.num_pending == 2
