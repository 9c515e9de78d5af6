"""Offline automatic prefix caching: jaxserve with prefix caching off and on, and vLLM's CPU build with it on,
on the same shared-prefix requests, same run.

Requests come from shared/workloads/shared_prefix.jsonl: a few long prefixes (system prompts), each request
one of them followed by its own suffix, then exactly `output_len` new tokens (greedy, ignore_eos; checked
for every request). Token ids are seeded: the prefix from `np.random.default_rng(prefix_id)` (the same ids for
every request of that prefix), the suffix from `np.random.default_rng(1000 + id)`, `.integers(100, vocab)`.
All requests are added at once; each run is measured in a fresh process of its own and start-up (load,
warm-up, compilation) is not counted. Prints each run's JSON as it finishes, then a markdown table: seconds,
output tokens/s, prompt tokens computed by prefill (jaxserve: `stats.num_prefill_tokens`; vLLM: prompt tokens
less the cached ones), cached prompt tokens (the sum of the outputs' `num_cached_tokens`), hit rate (cached
over prompt tokens), jaxserve with caching on over each run's throughput ("jaxserve on / it") and on over off.
Then the workload's repeated-prefix share (the prefill a perfect cache saves) and whether jaxserve's computed
prefill fell by at least that share rounded down to whole blocks (a request admitted in the same step as the
first of its prefix finds nothing cached yet, so all-at-once runs may fall short by a few prefixes).

    python scripts/bench_prefix_caching.py                       # all 96 requests: jaxserve off, then on
    python scripts/bench_prefix_caching.py --num-requests 8      # a smoke run
    python scripts/bench_prefix_caching.py --baseline vllm       # and vLLM bfloat16 with prefix caching on
    python scripts/bench_prefix_caching.py --baseline vllm --out results.md   # the table appended to a file

vLLM runs from its own virtualenv (shared/tools/install_vllm_cpu.sh; see scripts/baselines.py) on the embedded
model dequantized to float32, `enable_prefix_caching=True` passed explicitly, in `--vllm-dtype`; it caches
whole blocks of its own size, so its cached tokens may fall short of jaxserve's by the prefixes' last blocks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's jaxserve, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines  # noqa: E402  (standard library only: vLLM's location and settings)
from bench_throughput import add_requests, check_token_counts, in_fresh_process  # noqa: E402

DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "shared_prefix.jsonl"
JAXSERVE_ON, JAXSERVE_OFF = "jaxserve prefix caching on", "jaxserve prefix caching off"


# ----- the workload ------------------------------------------------------------------------------------


def load_workload(path: Path, num_requests: int | None = None) -> list[dict]:
    """The first `num_requests` lines of a shared-prefix workload (all when None)."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return lines[:num_requests]


def shared_prefix_prompt(request: dict, vocab_size: int) -> list[int]:
    """The request's prefix (seeded by prefix_id) followed by its own suffix (seeded by 1000 + id)."""
    prefix = np.random.default_rng(request["prefix_id"]).integers(100, vocab_size, size=request["prefix_len"])
    suffix = np.random.default_rng(1000 + request["id"]).integers(100, vocab_size, size=request["suffix_len"])
    return prefix.tolist() + suffix.tolist()


def shared_prefix_requests(workload: list[dict], vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) of every request."""
    return [(shared_prefix_prompt(r, vocab_size), r["output_len"]) for r in workload]


def repeated_prefix_tokens(workload: list[dict], block_size: int = 1) -> int:
    """Prefix tokens a perfect cache serves: every request's prefix but the first of each prefix_id,
    rounded down to whole blocks of `block_size` (only full blocks are cached)."""
    lengths = {r["prefix_id"]: r["prefix_len"] for r in workload}
    assert all(lengths[r["prefix_id"]] == r["prefix_len"] for r in workload), "one prefix_len per prefix_id"
    counts = Counter(r["prefix_id"] for r in workload)
    return sum((n - 1) * (lengths[p] // block_size * block_size) for p, n in counts.items())


# ----- the runs ----------------------------------------------------------------------------------------


def _counters(engine) -> dict[str, int]:
    stats = engine.make_stats()
    return {"num_prefill_tokens": stats.engine.num_prefill_tokens, "num_preemptions": stats.engine.num_preemptions,
            "prefix_cache_queries": stats.scheduler.prefix_cache_queries,
            "prefix_cache_hits": stats.scheduler.prefix_cache_hits}


def bench_jaxserve(args, requests: list[tuple[list[int], int]], caching: bool) -> dict:
    from jaxserve import LLM

    start = time.perf_counter()
    llm = LLM(dtype=args.dtype, max_model_len=args.max_model_len, buckets=args.buckets,
              enable_prefix_caching=caching)
    startup = time.perf_counter() - start
    engine = llm.llm_engine
    before = _counters(engine)

    start = time.perf_counter()
    add_requests(engine, requests)
    counts: dict[int, int] = {}
    cached: dict[int, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                i = int(out.request_id.removeprefix("bench-"))
                counts[i], cached[i] = len(out.outputs[0].token_ids), out.num_cached_tokens or 0
    elapsed = time.perf_counter() - start
    check_token_counts("jaxserve", [counts.get(i, 0) for i in range(len(requests))], requests)
    after = _counters(engine)
    grown = lambda name: after[name] - before[name]  # this run's share of a counter
    return {
        "engine": JAXSERVE_ON if caching else JAXSERVE_OFF, "seconds": elapsed, "startup_s": startup,
        "output_tokens": sum(counts.values()), "prompt_tokens": sum(len(p) for p, _ in requests),
        "prefill_tokens": grown("num_prefill_tokens"), "cached_tokens": sum(cached.values()),
        "prefix_cache_queries": grown("prefix_cache_queries"), "prefix_cache_hits": grown("prefix_cache_hits"),
        "preemptions": grown("num_preemptions"), "block_size": engine.block_size,
    }


def bench_vllm(args, requests: list[tuple[list[int], int]], dtype: str) -> dict:
    result = baselines.run_vllm_offline(requests, dtype=dtype, max_model_len=args.max_model_len,
                                        env=baselines.vllm_env(), enable_prefix_caching=True)
    result["prefill_tokens"] = result["prompt_tokens"] - result["cached_tokens"]
    return result


# ----- the report --------------------------------------------------------------------------------------


def table(results: list[dict]) -> str:
    on_tps = next(r["output_tokens"] / r["seconds"] for r in results if r["engine"] == JAXSERVE_ON)
    lines = ["| engine | seconds | output tok/s | prefill tokens computed | cached prompt tokens | hit rate | "
             "jaxserve on / it |", "|---|---|---|---|---|---|---|"]
    for r in results:
        tps = r["output_tokens"] / r["seconds"]
        lines.append(f"| {r['engine']} | {r['seconds']:.1f} | {tps:.1f} | {r['prefill_tokens']} | "
                     f"{r['cached_tokens']} | {r['cached_tokens'] / r['prompt_tokens']:.1%} | {on_tps / tps:.2f}x |")
    return "\n".join(lines)


def summary(results: list[dict], workload: list[dict]) -> str:
    by_engine = {r["engine"]: r for r in results}
    on, off = by_engine[JAXSERVE_ON], by_engine[JAXSERVE_OFF]
    total, block_size = on["prompt_tokens"], on["block_size"]
    repeated, in_blocks = repeated_prefix_tokens(workload), repeated_prefix_tokens(workload, block_size)
    fell = total - on["prefill_tokens"]
    speedup = (on["output_tokens"] / on["seconds"]) / (off["output_tokens"] / off["seconds"])
    lines = [
        f"on/off (jaxserve output tok/s, prefix caching on over off): {speedup:.2f}x",
        f"repeated-prefix share: {repeated / total:.1%} of {total} prompt tokens (the prefill a perfect cache "
        f"saves); in whole blocks of {block_size}: {in_blocks / total:.1%} ({in_blocks} tokens)",
        f"jaxserve's computed prefill fell by {fell / total:.1%} ({fell} tokens; caching off computed "
        f"{off['prefill_tokens']}): {'at least' if fell >= in_blocks else 'LESS than'} the whole-block share",
        f"jaxserve prefix cache stats (caching on): {on['prefix_cache_hits']} hits of "
        f"{on['prefix_cache_queries']} queried tokens; start-up {on['startup_s']:.1f}s; "
        f"preemptions off {off['preemptions']}, on {on['preemptions']}",
    ]
    return "\n".join(lines)


def report(results: list[dict], workload: list[dict]) -> str:
    head = f"{len(workload)} requests of shared_prefix, all at once, greedy, ignore_eos"
    return f"{head}\n\n{table(results)}\n\n{summary(results, workload)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--num-requests", type=int, default=None, help="default: all of the workload")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="auto", help="jaxserve's (default: its default, auto)")
    parser.add_argument("--buckets", default=None, help="jaxserve's bucket file")
    parser.add_argument("--baseline", default="", help="empty (default) or vllm")
    parser.add_argument("--vllm-dtype", default="bfloat16", help="comma-separated: one vLLM run for each")
    parser.add_argument("--out", type=Path, default=None, help="also append the report to this file")
    args = parser.parse_args()
    if args.baseline not in ("", "vllm"):
        parser.error(f"unknown --baseline {args.baseline!r} (empty or vllm)")

    from jaxserve.weights import load_config, resolve_model_path

    workload = load_workload(args.workload, args.num_requests)
    requests = shared_prefix_requests(workload, load_config(resolve_model_path(None)).vocab_size)
    runs = [(bench_jaxserve, args, requests, False), (bench_jaxserve, args, requests, True)]
    if args.baseline == "vllm":
        runs += [(bench_vllm, args, requests, dtype) for dtype in filter(None, args.vllm_dtype.split(","))]
    results = []
    for fn, *fn_args in runs:
        results.append(in_fresh_process(fn, *fn_args))
        print(json.dumps(results[-1]), flush=True)  # each run's figures as soon as they exist
    text = report(results, workload)
    print(text)
    if args.out:
        with open(args.out, "a") as out:
            out.write(text + "\n\n")


if __name__ == "__main__":
    main()
