"""Speculative decoding benchmark: n-gram speculation on against off, on copying requests, at several concurrencies.

Requests: shared/workloads/repetitive_edits.jsonl (its recipe: scripts/make_repetitive_workload.py; built in memory
from the recipe when the file is missing), tasks interleaved (repeat, rewrite, code_edit, repeat, ...), the first
`--num-prompts`. Each is sent to /v1/chat/completions, streamed, greedy, exactly `output_len` tokens
(`ignore_eos`), so every server does the same work. At each concurrency (`--concurrencies`) every request is sent
at once and at most that many are in flight; the figure is output tokens per second over the run (decode
dominates: the prompts are 144-298 tokens, the outputs 106-306), with mean TTFT and mean TPOT.

Servers, each started in turn on 127.0.0.1 (as scripts/bench_serving.py starts them) and measured at every
concurrency:
- `jaxserve`: no speculation;
- `jaxserve-ngram`: `--speculative-config` method ngram, `--num-speculative-tokens` (4), prompt lookup
  `--prompt-lookup-min`..`--prompt-lookup-max` (2..4), the default `disable_by_batch_size` (no drafts while more
  sequences decode than it: 8);
- `jaxserve-ngram-always`: the same with `disable_by_batch_size` 64 (speculation at every concurrency: where it
  stops paying is the crossover that default is set from);
- `jaxserve-suffix`: method suffix (suffix decoding: tries of the request's tokens and of earlier responses),
  `--num-speculative-tokens` drafts at most, vLLM's other suffix defaults;
- `vllm`, `vllm-ngram`: vLLM's CPU build off and with the same speculative config (`--speculative-config`).
A server is started once and measured at every concurrency, the same requests each time, after a warm-up of the
two requests past the measured ones; `--restart-per-concurrency` starts it afresh for each, so that what a server
keeps across requests (its prefix cache, suffix decoding's responses) holds only that concurrency's requests.
Draft acceptance is read from each server's /metrics (`*spec_decode_num_draft_tokens_total`,
`*spec_decode_num_accepted_tokens_total`) before and after each run.

    python scripts/bench_speculative.py --result-dir /tmp/spec-bench                      # the whole comparison
    python scripts/bench_speculative.py --servers jaxserve,jaxserve-ngram --concurrencies 1 --num-prompts 3
    python scripts/bench_speculative.py --servers jaxserve,jaxserve-ngram --concurrencies 8,16 \
        --workload ../shared/workloads/chat_questions.jsonl --num-prompts 32   # chats: what drafts cost there
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import (  # noqa: E402
    SERVED_MODEL_NAME,
    file_stem,
    free_port,
    server_command,
    sse_chunks,
    stop_server,
    wait_ready,
)
from make_repetitive_workload import requests as workload_requests  # noqa: E402
from plot_load_sweep import write_sweep_plot  # noqa: E402

WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "repetitive_edits.jsonl"
SERVERS = ("jaxserve", "jaxserve-ngram", "jaxserve-ngram-always", "jaxserve-suffix", "vllm", "vllm-ngram")
ALWAYS = 64  # disable_by_batch_size of jaxserve-ngram-always: more than any concurrency measured


@dataclasses.dataclass
class Result:
    ok: bool = False
    error: str = ""
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0


def load_requests(args) -> list[dict]:
    """The workload's requests, tasks interleaved, the first --num-prompts and two more (the warm-up's)."""
    path = Path(args.workload)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else (
        workload_requests())
    by_task: dict[str, list[dict]] = {}
    for row in rows:  # another workload's rows (a chat's messages alone): one task, --output-len tokens
        row.setdefault("output_len", args.output_len)
        by_task.setdefault(row.get("task", "chat"), []).append(row)
    interleaved = [row for group in zip(*by_task.values(), strict=False) for row in group]
    return interleaved[: args.num_prompts + 2]


def speculative_config(args, disable_by_batch_size: int | None = None, method: str = "ngram") -> str:
    config = {"method": method, "num_speculative_tokens": args.num_speculative_tokens}
    if method == "ngram":
        config.update(prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max)
    if disable_by_batch_size is not None:
        config["disable_by_batch_size"] = disable_by_batch_size
    return json.dumps(config)


def command(args, server: str, port: int) -> tuple[list[str], dict]:
    """The server's command line: bench_serving's jaxserve or vLLM, with the speculative flags of its variant."""
    base = "vllm" if server.startswith("vllm") else "jaxserve"
    cmd, env = server_command(args, base, port)
    if server.endswith("-ngram"):
        cmd += ["--speculative-config", speculative_config(args)]
    elif server.endswith("-ngram-always"):
        cmd += ["--speculative-config", speculative_config(args, ALWAYS)]
    elif server.endswith("-suffix"):
        cmd += ["--speculative-config", speculative_config(args, method="suffix")]
    return cmd, env


async def send(client: httpx.AsyncClient, request: dict) -> Result:
    body = {"model": SERVED_MODEL_NAME, "messages": request["messages"], "max_tokens": request["output_len"],
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result = Result()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = (await response.aread()).decode()
                return result
            async for chunk in sse_chunks(response):
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content") and not result.ttft:
                    result.ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
        result.latency = time.perf_counter() - start
        result.ok = result.output_len == request["output_len"]
        if not result.ok:
            result.error = f"expected {request['output_len']} tokens, got {result.output_len}"
    except httpx.HTTPError as err:
        result.error = f"{type(err).__name__}: {err}"
    return result


async def run_concurrency(base_url: str, requests: list[dict], concurrency: int) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
        semaphore = asyncio.Semaphore(concurrency)

        async def limited(request):
            async with semaphore:
                return await send(client, request)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(r) for r in requests))
        return results, time.perf_counter() - start


def spec_counters(base_url: str) -> dict:
    """The server's draft and accepted token counters from /metrics (jaxserve's and vLLM's names)."""
    counters = {"draft_tokens": 0.0, "accepted_tokens": 0.0}
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{")[0].split()[0]
        for key in counters:
            if name.endswith(f"spec_decode_num_{key}_total"):
                counters[key] += float(line.split()[-1])
    return counters


def summarize(server: str, concurrency: int, results: list[Result], duration: float, spec: dict) -> dict:
    done = [r for r in results if r.ok]
    tokens = sum(r.output_len for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1]
    return {
        "server": server, "rate": concurrency, "completed": len(done), "failed": len(results) - len(done),
        "errors": [r.error for r in results if not r.ok][:3], "duration_s": duration,
        "output_throughput": tokens / duration, "mean_ttft_ms": 1e3 * float(np.mean([r.ttft for r in done] or [0])),
        "mean_tpot_ms": 1e3 * float(np.mean(tpots or [0])),
        "acceptance": spec["accepted_tokens"] / spec["draft_tokens"] if spec["draft_tokens"] else None,
        "draft_tokens": spec["draft_tokens"],
    }


def measure_server(args, server: str, requests: list[dict], result_dir: Path) -> list[dict]:
    """The server's rows at every concurrency: one server for all, or a fresh one for each."""
    if not args.restart_per_concurrency:
        return measure_server_at(args, server, requests, result_dir, args.concurrencies)
    return [row for concurrency in args.concurrencies
            for row in measure_server_at(args, server, requests, result_dir, [concurrency])]


def measure_server_at(args, server: str, requests: list[dict], result_dir: Path, concurrencies) -> list[dict]:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd, env = command(args, server, port)
    rows = []
    measured, warm_up = requests[: args.num_prompts], requests[args.num_prompts :] or requests[:2]
    with open(result_dir / f"{file_stem(server)}-{'-'.join(map(str, concurrencies))}-server.log", "w") as log:
        print(f"starting {server}: {' '.join(cmd)}", flush=True)
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            print(f"{server} ready after {wait_ready(proc, base_url, args.server_timeout):.0f}s", flush=True)
            asyncio.run(run_concurrency(base_url, warm_up, 2))
            for concurrency in concurrencies:
                before = spec_counters(base_url)
                results, duration = asyncio.run(run_concurrency(base_url, measured, concurrency))
                after = spec_counters(base_url)
                row = summarize(server, concurrency, results, duration, {k: after[k] - before[k] for k in after})
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            stop_server(proc)
    return rows


def report(rows: list[dict]) -> str:
    """A markdown table: each server's output tok/s, mean TPOT and acceptance per concurrency, and its throughput
    over the same engine's without speculation."""
    lines = ["| server | concurrency | output tok/s | vs off | mean TPOT (ms) | mean TTFT (ms) | draft acceptance |",
             "|---|---|---|---|---|---|---|"]
    off = {(r["server"].split("-")[0], r["rate"]): r["output_throughput"] for r in rows if "-" not in r["server"]}
    for r in rows:
        base = off.get((r["server"].split("-")[0], r["rate"]))
        ratio = f"{r['output_throughput'] / base:.2f}x" if base else "-"
        acceptance = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        failed = f" ({r['failed']} failed)" if r["failed"] else ""
        lines.append(f"| {r['server']} | {r['rate']} | {r['output_throughput']:.1f}{failed} | {ratio} | "
                     f"{r['mean_tpot_ms']:.1f} | {r['mean_ttft_ms']:.0f} | {acceptance} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)}")
    parser.add_argument("--concurrencies", default="1,4,16")
    parser.add_argument("--workload", default=str(WORKLOAD))
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=128, help="of a workload's rows that give none")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="auto", help="jaxserve's")
    parser.add_argument("--vllm-dtype", default="bfloat16")
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=4)
    parser.add_argument("--vllm-omp-bind", default="auto")
    parser.add_argument("--vllm-reserved-cpus", type=int, default=None)
    parser.add_argument("--server-timeout", type=float, default=900)
    parser.add_argument("--restart-per-concurrency", action="store_true",
                        help="a fresh server for each concurrency (nothing kept from the one before)")
    parser.add_argument("--result-dir", default=None)
    parser.add_argument("--plot", default=None, help="SVG of tok/s and TPOT against concurrency (default: result dir)")
    args = parser.parse_args()
    args.concurrencies = [int(c) for c in args.concurrencies.split(",")]
    result_dir = Path(args.result_dir or tempfile.mkdtemp(prefix="bench-speculative-"))
    result_dir.mkdir(parents=True, exist_ok=True)
    args.result_dir = str(result_dir)
    requests = load_requests(args)
    rows = []
    for server in args.servers.split(","):
        try:
            rows += measure_server(args, server, requests, result_dir)
        except (RuntimeError, TimeoutError) as err:  # a server that does not start (vLLM without the option)
            print(f"{server}: not measured: {err}", flush=True)
    (result_dir / "rows.json").write_text(json.dumps(rows, indent=1))
    table = report(rows)
    print(table)
    (result_dir / "table.md").write_text(table + "\n")
    plot = Path(args.plot) if args.plot else result_dir / "speculative.svg"
    write_sweep_plot(plot, f"speculation, {args.num_prompts} requests",
                     rows, (("output_throughput", "output tok/s"), ("mean_tpot_ms", "mean TPOT (ms)")),
                     "concurrency")
    print(f"results: {result_dir}; plot: {plot}")


if __name__ == "__main__":
    main()
