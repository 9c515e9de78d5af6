"""Warm-up: build every bucket's executable, from the compile cache directory where it has them, and report.

Place in the data flow: the engine's warm-up (`engine/engine_builder.py`) and the precompile command both call
`compile_buckets` with the `ModelRunner` (a real one, or an abstract one that holds no device memory) and the grid's
buckets. Each bucket's executable is loaded from the runner's `ExecutableStore` (serialized executables in the compile
cache directory) or lowered from `ShapeDtypeStruct`s and compiled; the per-thread compile counters of
`jaxserve.compilation.compile_cache` tell whether a compiled one came from JAX's persistent cache or was compiled
fresh. Both kinds of load count as "cache hit". The `WarmUpReport` is what start-up logs and what the precompile
command prints as its table.

Buckets may compile in several threads (`num_threads`): tracing and lowering hold the GIL, XLA's
compilation releases it. Whether that helps depends on the host (see docs/benchmarks/startup.md).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from tqdm.auto import tqdm

from jaxserve.compilation.compile_cache import CacheCheck, CacheManifest, check_manifest, thread_compile_counts
from jaxserve.compilation.executable_store import ExecutableStore
from jaxserve.core.buckets import Bucket, MixedBucket, PrefillBucket
from jaxserve.logger import init_logger
from jaxserve.runner.input_batch import StepShape, step_shape
from jaxserve.runner.model_runner import ModelRunner, executable_name, sample_shapes

logger = init_logger("jaxserve.compilation.warm_up")

FROM_CACHE, FRESH, IN_MEMORY = "cache hit", "fresh", "in memory"
# Measured (docs/benchmarks/startup.md): on a 2-core CPU host two threads compiled 26 buckets no faster than one.
DEFAULT_COMPILE_THREADS = 1


@dataclasses.dataclass(frozen=True)
class BucketCompile:
    """One executable: its bucket, the seconds it took and where it came from."""

    bucket: Bucket
    seconds: float
    source: str  # FROM_CACHE, FRESH, or IN_MEMORY (this runner had already built it)


@dataclasses.dataclass
class WarmUpReport:
    compiles: list[BucketCompile]
    seconds: float
    num_threads: int
    cache_dir: Path | None = None
    cache_check: CacheCheck | None = None

    def _count(self, source: str) -> int:
        return sum(c.source == source for c in self.compiles)

    @property
    def num_buckets(self) -> int:
        return len(self.compiles)

    @property
    def num_cache_hits(self) -> int:
        return self._count(FROM_CACHE)

    @property
    def num_fresh(self) -> int:
        return self._count(FRESH)

    def summary(self) -> str:
        where = f" (compile cache {self.cache_dir})" if self.cache_dir else " (no persistent compile cache)"
        in_memory = self._count(IN_MEMORY)
        return (
            f"{self.num_buckets} buckets in {self.seconds:.1f}s: {self.num_cache_hits} from "
            f"the compile cache, {self.num_fresh} compiled fresh"
            + (f", {in_memory} already in memory" if in_memory else "")
            + f", {self.num_threads} thread{'s' if self.num_threads > 1 else ''}{where}"
        )

    def format_table(self) -> str:
        rows = [(_bucket_name(c.bucket), f"{c.seconds:.2f}", c.source) for c in self.compiles]
        headers = ("bucket", "seconds", "source")
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        line = lambda cells: "  ".join(
            cell.ljust(w) if i != 1 else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        )
        return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows), self.summary()])


def _bucket_name(bucket: Bucket) -> str:
    if isinstance(bucket, MixedBucket):
        return f"mixed   b={bucket.batch_size} tokens={bucket.num_tokens} ctx={bucket.context_len}"
    if isinstance(bucket, PrefillBucket):
        return f"prefill b={bucket.batch_size} chunk={bucket.chunk_len} ctx={bucket.context_len}"
    return f"decode  b={bucket.batch_size} ctx={bucket.context_len}"


def use_compile_cache(runner: ModelRunner, cache_dir: Path, manifest: CacheManifest) -> CacheCheck:
    """Checks (and logs) what ``cache_dir`` holds for ``manifest`` and gives ``runner`` the directory's
    executable store for that configuration; the engine's warm-up and precompile both start here."""
    check = check_manifest(cache_dir, manifest)
    (logger.info if check.state in ("match", "empty") else logger.warning)("%s", check.describe())
    runner.executable_store = ExecutableStore(cache_dir, manifest, first_device=runner.mesh.devices.flat[0].id)
    return check


def _compile_one(runner: ModelRunner, shape: StepShape) -> tuple[float, str]:
    already_built = shape in runner.executables
    before = thread_compile_counts()
    start = time.perf_counter()
    runner.compile(shape)
    seconds = time.perf_counter() - start
    counts = thread_compile_counts() - before
    if already_built:
        return seconds, IN_MEMORY
    store = runner.executable_store
    if store is not None and executable_name(shape) in store.loaded:
        return seconds, FROM_CACHE  # deserialized: no lowering, no XLA compile event
    return seconds, FROM_CACHE if counts.fresh_compiles == 0 else FRESH


def compile_bucket(runner: ModelRunner, bucket: Bucket) -> None:
    """Builds one bucket's step executable and its sampler's (the background compiler's unit of work)."""
    shape = step_shape(bucket, runner.block_size)
    runner.compile(shape)
    runner.compile_sampler(shape.sample_shape)


def compile_buckets(
    runner: ModelRunner,
    buckets: Sequence[Bucket],
    *,
    num_threads: int = 1,
    progress: bool = False,
    cache_dir: Path | None = None,
    cache_check: CacheCheck | None = None,
) -> WarmUpReport:
    """Builds the executable of every bucket (each distinct step shape once) and reports where each came from;
    with them the sampler executable of each of the steps' sample shapes (their batch sizes)."""
    if num_threads < 1:
        raise ValueError(f"num_threads must be a positive integer, got {num_threads}")
    shapes = list(dict.fromkeys(step_shape(b, runner.block_size) for b in buckets))
    results: dict[StepShape, tuple[float, str]] = {}
    start = time.perf_counter()
    with (
        ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="jaxserve-compile") as pool,
        tqdm(total=len(shapes), desc="Compiling buckets", unit="bucket", disable=not progress) as bar,
    ):
        futures = {pool.submit(_compile_one, runner, shape): shape for shape in shapes}
        for shape in sample_shapes(shapes):
            futures[pool.submit(runner.compile_sampler, shape)] = None
        for future in as_completed(futures):
            result = future.result()
            if futures[future] is not None:
                results[futures[future]] = result
                bar.update(1)
    seconds = time.perf_counter() - start
    compiles = [BucketCompile(b, *results[step_shape(b, runner.block_size)]) for b in buckets]
    return WarmUpReport(compiles, seconds, num_threads, cache_dir, cache_check)
