"""Two jaxserve replicas behind vLLM's router: the prefix-cache hit rate and time to first token of each routing
policy on the shared-prefix workload, same replicas, same run.

    python scripts/bench_router.py                                   # round_robin, cache_aware, kv_aware
    python scripts/bench_router.py --policies round_robin kv_aware --num-requests 32 --out results.md

Two replicas of the embedded model (`python -m jaxserve.entrypoints.api_server`, float32, `--num-kv-blocks` each,
the second started after the first so that it loads the compiled steps from the compile cache), each publishing
its KV cache events (`--kv-events-config`, vLLM's format) on a port of its own. For each policy: both replicas'
prefix caches are flushed through the router (`POST /flush_cache`, which it sends to every worker), then
`vllm-router --policy P` routes `../shared/workloads/shared_prefix.jsonl` (token-id prompts: prefix seeded by
prefix_id, suffix by 1000 + id, as `bench_prefix_caching.py`; greedy, `min(output_len, --max-tokens)` tokens,
ignore_eos, streamed) at `--concurrency` requests at a time. `kv_aware` finds the replicas' event publishers
itself (`/get_server_info`, `/kv_event_sources`); `cache_aware` routes by its own record of past prompts.
Measured: prompt tokens the replicas found cached over those they looked up (their /metrics), mean and p50/p90
time to first token seen by the client, requests per replica, wall time.

The pool is deliberately small (192 blocks of 16 tokens, 3072 tokens per replica): it holds about two of the four
prefixes with the requests running, so a policy that sends every prefix to both replicas evicts them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's jaxserve, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prefix_caching import DEFAULT_WORKLOAD, load_workload, shared_prefix_prompt  # noqa: E402

from jaxserve.testing.ports import free_port  # noqa: E402

VOCAB_SIZE = 49152  # the embedded SmolLM2's
POLICIES = ("round_robin", "cache_aware", "kv_aware")
ROUTER = Path(sys.executable).with_name("vllm-router")
START_TIMEOUT_S = 900


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{log} ended:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become healthy:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start_replicas(args, work: Path) -> list[tuple[str, subprocess.Popen]]:
    replicas = []
    for i in range(2):
        port, events = free_port(), free_port()
        config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events}"})  # a wildcard binds
        cmd = [sys.executable, "-m", "jaxserve.entrypoints.api_server", "--dtype", "float32", "--max-model-len", "1024",
               "--max-num-seqs", "16", "--num-kv-blocks", str(args.num_kv_blocks), "--host", "127.0.0.1",
               "--port", str(port), "--kv-events-config", config]
        log = work / f"replica{i}.log"
        replicas.append((f"http://127.0.0.1:{port}", start(cmd, log)))
        wait_healthy(replicas[-1][0], replicas[-1][1], log)
    return replicas


def start_router(policy: str, replicas, work: Path) -> tuple[str, subprocess.Popen]:
    port = free_port()
    cmd = [str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls",
           *[url for url, _ in replicas], "--worker-startup-check-interval", "1", "--prometheus-port", str(free_port())]
    log = work / f"router-{policy}.log"
    proc = start(cmd, log)
    wait_healthy(f"http://127.0.0.1:{port}", proc, log)
    return f"http://127.0.0.1:{port}", proc


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    total = lambda name: sum(float(v) for v in re.findall(rf"^jaxserve:{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return {name: total(name) for name in ("prefix_cache_queries", "prefix_cache_hits", "request_success")}


def first_token_seconds(router: str, model: str, prompt: list[int], max_tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    started, first = time.perf_counter(), None
    with httpx.stream("POST", router + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                first = time.perf_counter() - started
    return first


def run_policy(policy: str, replicas, requests, args, work: Path) -> dict:
    router, proc = start_router(policy, replicas, work)
    try:
        flushed = httpx.post(router + "/flush_cache", timeout=60)
        flushed.raise_for_status()
        model = httpx.get(replicas[0][0] + "/v1/models").json()["data"][0]["id"]
        before = [counters(url) for url, _ in replicas]
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            ttfts = list(pool.map(lambda r: first_token_seconds(router, model, *r), requests))
        wall = time.perf_counter() - started
        after = [counters(url) for url, _ in replicas]
    finally:
        stop(proc)
    delta = lambda name: [a[name] - b[name] for a, b in zip(after, before, strict=True)]
    ttfts.sort()
    return {
        "policy": policy, "requests": len(requests), "hit_rate": sum(delta("prefix_cache_hits")) / sum(
            delta("prefix_cache_queries")),
        "ttft_mean_s": statistics.mean(ttfts), "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))], "per_replica": [int(n) for n in delta("request_success")],
        "wall_s": wall,
    }


def table(results: list[dict]) -> str:
    base = results[0]
    lines = ["| policy | prefix-cache hit rate | mean TTFT (s) | against " + base["policy"] + " | p50 / p90 TTFT (s) "
             "| requests per replica | wall (s) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        speedup = base["ttft_mean_s"] / r["ttft_mean_s"]
        lines.append(f"| {r['policy']} | {r['hit_rate']:.1%} | {r['ttft_mean_s']:.2f} | {speedup:.2f}x | "
                     f"{r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f} | {' / '.join(map(str, r['per_replica']))} | "
                     f"{r['wall_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-kv-blocks", type=int, default=192)
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = load_workload(args.workload, args.num_requests)
    requests = [(shared_prefix_prompt(r, VOCAB_SIZE), min(r["output_len"], args.max_tokens)) for r in rows]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        replicas = start_replicas(args, Path(tmp))
        try:
            for policy in args.policies:
                results.append(run_policy(policy, replicas, requests, args, Path(tmp)))
                print(json.dumps(results[-1]), flush=True)
        finally:
            for _, proc in replicas:
                stop(proc)
    print(table(results))
    if args.out:
        with open(args.out, "a") as f:
            f.write(table(results) + "\n")


if __name__ == "__main__":
    main()
