"""Start-up time of `LLM(...)` with a cold and then a warm compile cache, each in a fresh process, one run.

    python scripts/bench_startup.py                        # embedded model, default CPU bucket file
    python scripts/bench_startup.py --model DIR --max-model-len 1024 --compare-threads 1 2

1. cold: `LLM(model, compile_cache_dir=<empty temporary directory>)`: every bucket compiles fresh
   (and is written to the cache);
2. warm: the same in a new process on the same directory: every bucket loads from the cache.

Each start runs in its own interpreter, so no in-memory JAX cache survives between them. Reported:
wall seconds of `LLM(...)` (load, pool allocation and warm-up), of which warm-up, the process's CPU
seconds (all threads; steadier than wall time on a shared machine), buckets from the cache and
fresh, and warm/cold. `--compare-threads` also precompiles the grid cold into fresh directories with
each thread count (parallel compilation). Output is markdown, for docs/benchmarks/startup.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return {"max_model_len": args.max_model_len, "buckets": args.buckets, "dtype": args.dtype}


def child_start(args: argparse.Namespace) -> dict:
    """One `LLM(...)` start in this (fresh) process."""
    start = time.perf_counter()
    from jaxserve import LLM

    imported = time.perf_counter()
    llm = LLM(args.model, compile_cache_dir=args.cache_dir, **_engine_kwargs(args))
    started = time.perf_counter()
    report = llm.llm_engine.warm_up_report
    return {
        "import_s": imported - start, "startup_s": started - imported, "warm_up_s": report.seconds,
        "cpu_s": time.process_time(), "hits": report.num_cache_hits, "fresh": report.num_fresh,
        "buckets": report.num_buckets,
    }


def child_precompile(args: argparse.Namespace) -> dict:
    """A cold precompile with ``args.threads`` threads in this (fresh) process."""
    from jaxserve.compilation.precompile import precompile
    from jaxserve.config.engine_config import EngineConfig

    cpu_before = time.process_time()
    result = precompile(
        EngineConfig(model=args.model, **_engine_kwargs(args)), args.cache_dir, num_threads=args.threads
    )
    return {
        "seconds": result.report.seconds, "cpu_s": time.process_time() - cpu_before,
        "fresh": result.report.num_fresh, "buckets": result.report.num_buckets,
    }


def _spawn(args: argparse.Namespace, mode: str, cache_dir: Path, threads: int = 1) -> dict:
    command = [
        sys.executable, __file__, "--child", mode, "--cache-dir", str(cache_dir), "--threads", str(threads),
        "--buckets", args.buckets, "--dtype", args.dtype,
    ]
    if args.model:
        command += ["--model", args.model]
    if args.max_model_len:
        command += ["--max-model-len", str(args.max_model_len)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAXSERVE_LOGGING_LEVEL": "WARNING"}
    wall = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"{mode} run failed:\n{result.stderr[-3000:]}")
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    measured["process_s"] = time.perf_counter() - wall
    print(f"{mode} ({cache_dir.name}): {measured}", file=sys.stderr, flush=True)
    return measured


def run(args: argparse.Namespace) -> str:
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="jaxserve-bench-startup-") as tmp:
        cache = Path(tmp) / "cache"
        cold = _spawn(args, "start", cache)
        warm = _spawn(args, "start", cache)
        threads = {n: _spawn(args, "precompile", Path(tmp) / f"threads{n}", n) for n in args.compare_threads}
    load_after = os.getloadavg()
    model = args.model or "embedded SmolLM2-135M-Instruct (GGUF)"
    lines = [
        f"model {model}, {args.dtype}, bucket file {args.buckets}, max_model_len {args.max_model_len or 'derived'}; "
        f"{os.cpu_count()} CPUs, load average {load[0]:.1f} before, {load_after[0]:.1f} after",
        "",
        "| start | `LLM(...)` s | of which warm-up s | CPU s (process) | buckets from cache | compiled fresh |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in (("cold cache", cold), ("warm cache", warm)):
        lines.append(
            f"| {name} | {m['startup_s']:.1f} | {m['warm_up_s']:.1f} | {m['cpu_s']:.1f} | {m['hits']} | {m['fresh']} |"
        )
    lines += [
        "",
        f"warm / cold: {warm['startup_s'] / cold['startup_s']:.0%} of the `LLM(...)` time, "
        f"{warm['warm_up_s'] / cold['warm_up_s']:.0%} of the warm-up time, "
        f"{warm['cpu_s'] / cold['cpu_s']:.0%} of the process CPU time "
        f"(imports, not counted above: {cold['import_s']:.1f} s and {warm['import_s']:.1f} s)",
    ]
    if threads:
        lines += ["", "| precompile threads | wall s | CPU s | buckets compiled |", "|---|---|---|---|"]
        lines += [f"| {n} | {m['seconds']:.1f} | {m['cpu_s']:.1f} | {m['fresh']} |" for n, m in threads.items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded model)")
    parser.add_argument("--buckets", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--compare-threads", type=int, nargs="*", default=[],
                        help="also precompile cold with each of these thread counts")
    parser.add_argument("--child", choices=["start", "precompile"], help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "start":
        print(json.dumps(child_start(args)))
    elif args.child == "precompile":
        print(json.dumps(child_precompile(args)))
    else:
        print(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
