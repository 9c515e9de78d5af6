"""Online serving benchmark against a running server's /v1/completions with streaming, as vLLM's
`benchmark_serving.py` measures it.

Requests come from shared/workloads/mixed_lengths.jsonl: prompts of exactly `prompt_len` token ids
(windows of one tokenized text, so valid for any model) and exactly `output_len` new tokens
(`ignore_eos`). They are sent at a Poisson rate (`--request-rate`, requests/s) or all at once (`inf`).
Reports request and token throughput and mean, median and p99 of time to first token (TTFT), time per
output token after the first (TPOT), inter-token latency (ITL, between stream chunks) and end-to-end
latency (E2EL), in milliseconds.

    jaxserve serve --max-model-len 2048 &                       # the embedded SmolLM2
    python scripts/bench_serving.py --num-prompts 16 --request-rate inf
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path

import httpx
import numpy as np

DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "mixed_lengths.jsonl"
SOURCE_TEXT = (
    "The history of computing is a story of abstraction layered on abstraction: switches became gates, "
    "gates became arithmetic units, and programs learned to write other programs. "
)


@dataclasses.dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)


async def served_model(client: httpx.AsyncClient) -> str:
    return (await client.get("/v1/models")).json()["data"][0]["id"]


async def build_prompts(client: httpx.AsyncClient, workload: list[dict]) -> list[list[int]]:
    """Token-id prompts of exactly each prompt_len: windows of one tokenized text."""
    longest = max(r["prompt_len"] for r in workload)
    text = SOURCE_TEXT
    ids: list[int] = []
    while len(ids) < 2 * longest:
        text += text
        ids = (await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})).json()["tokens"]
    prompts = []
    for i, request in enumerate(workload):
        start = (i * 37) % (len(ids) - request["prompt_len"])
        prompts.append(ids[start : start + request["prompt_len"]])
    return prompts


async def send_request(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(prompt_len=len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = (await response.aread()).decode()
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                now = time.perf_counter()
                if chunk.get("error"):
                    result.error = chunk["error"]["message"]
                    return result
                if chunk["choices"]:
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                elif chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
        result.latency = time.perf_counter() - start
        result.ok = result.output_len == output_len
        if not result.ok:
            result.error = f"expected {output_len} tokens, got {result.output_len}"
    except httpx.HTTPError as err:
        result.error = f"{type(err).__name__}: {err}"
    return result


async def run(args) -> dict:
    workload = [json.loads(line) for line in Path(args.workload).read_text().splitlines() if line.strip()]
    workload = workload[: args.num_prompts]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=None, limits=limits) as client:
        model = args.model or await served_model(client)
        prompts = await build_prompts(client, workload)
        rng = np.random.default_rng(args.seed)
        semaphore = asyncio.Semaphore(args.max_concurrency or len(workload))

        async def limited(prompt, output_len):
            async with semaphore:
                return await send_request(client, model, prompt, output_len)

        tasks = []
        start = time.perf_counter()
        for prompt, request in zip(prompts, workload, strict=True):
            tasks.append(asyncio.create_task(limited(prompt, request["output_len"])))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration)


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    failed = [r.error for r in results if not r.ok]
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1]
    itls = [x for r in done for x in r.itl]
    out_tokens = sum(r.output_len for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    summary = {
        "successful_requests": len(done), "failed_requests": len(failed), "errors": failed[:5],
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    for name, values in (("ttft", [r.ttft for r in done]), ("tpot", tpots), ("itl", itls),
                         ("e2el", [r.latency for r in done])):
        ms = np.asarray(values or [0.0]) * 1000
        summary.update({f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
                        f"p99_{name}_ms": float(np.percentile(ms, 99))})
    return summary


def print_summary(s: dict) -> None:
    print("=" * 20 + " Serving Benchmark Result " + "=" * 20)
    rows = [("Successful requests", s["successful_requests"]), ("Failed requests", s["failed_requests"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"), ("Total input tokens", s["total_input_tokens"]),
            ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.3f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    for label, value in rows:
        print(f"{label:<40}{value:>16}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print(f"{'-' * 15} {title} {'-' * 15}")
        for stat in ("mean", "median", "p99"):
            print(f"{stat.capitalize() + ' ' + name.upper() + ' (ms)':<40}{s[f'{stat}_{name}_ms']:>16.2f}")
    for error in s["errors"]:
        print("error:", error)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's)")
    parser.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals; inf sends all at once")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default=None, help="also write the summary here")
    args = parser.parse_args()
    summary = asyncio.run(run(args))
    print_summary(summary)
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
