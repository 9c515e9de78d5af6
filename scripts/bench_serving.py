"""Online serving benchmark against a running server's /v1/completions with streaming, as vLLM's
`benchmark_serving.py` measures it.

Requests come from shared/workloads/mixed_lengths.jsonl: prompts of exactly `prompt_len` token ids
(windows of one tokenized text, so valid for any model) and exactly `output_len` new tokens
(`ignore_eos`). A workload whose requests have a `prefix_id` (shared/workloads/shared_prefix.jsonl) is
built as scripts/bench_prefix_caching.py builds it: seeded token ids in [100, `--vocab-size`) (default: the
embedded model's), each request's shared prefix then its own suffix. `--max-output-len` caps every
request's output (smoke runs). They are sent at a Poisson rate (`--request-rate`, requests/s, seeded by
`--seed`) or all at once (`inf`).
Reports request and token throughput and mean, median and p99 of time to first token (TTFT), time per
output token after the first (TPOT), inter-token latency (ITL, between stream chunks) and end-to-end
latency (E2EL), in milliseconds.

    jaxserve serve --max-model-len 2048 &                       # the embedded SmolLM2
    python scripts/bench_serving.py --num-prompts 16 --request-rate inf

With `--servers jaxserve,vllm` the script instead starts each server itself, one at a time on 127.0.0.1
(jaxserve serving the embedded SmolLM2 GGUF; vLLM's CPU build, from its own virtualenv, serving the same
weights dequantized to a float32 safetensors directory: see scripts/baselines.py), waits until it answers
/health and /v1/models (`--server-timeout`), measures it with vLLM's own client, `vllm bench serve`
(random dataset of `--random-input-len` / `--random-output-len` tokens, seed 0 so both servers get the same
prompts, greedy, ignore_eos, `--num-prompts` at `--request-rate`), stops it, and goes on to the next. It
then prints one table from the clients' saved JSON results: output tok/s, mean/median/P99 TTFT, mean TPOT,
mean/P99 ITL, and jaxserve's figure over vLLM's ("jaxserve / vllm": above 1 is better for throughput,
below 1 is better for the latencies). The servers' logs and the client's results stay in `--result-dir`.

    python scripts/bench_serving.py --servers jaxserve,vllm      # 64 prompts, 256 in, 128 out, 2 req/s
    python scripts/bench_serving.py --servers jaxserve,vllm --num-prompts 4 --random-output-len 16
    python scripts/bench_serving.py --servers jaxserve,vllm --dtype bfloat16 --vllm-dtype bfloat16

With `--servers` and `--workload`, every server is measured with this script's own client on that workload
instead (`vllm bench serve` cannot send given token ids: its custom dataset sends text, its prefix_repetition
and timed_trace datasets make up their own token ids), so all servers get the same requests at the same
arrival times. Server `jaxserve-no-prefix-caching` is jaxserve with `--no-enable-prefix-caching` (prefix
caching is on by default); when it runs beside `jaxserve` the report adds the ratio of their median TTFT
(no caching / caching), and each server's prefix cache hits over queried tokens, read from its /metrics
(`*prefix_cache_hits_total` / `*prefix_cache_queries_total`) before and after the client's run:

    python scripts/bench_serving.py --servers jaxserve,jaxserve-no-prefix-caching \\
        --workload ../shared/workloads/shared_prefix.jsonl --request-rate 1
    python scripts/bench_serving.py --servers jaxserve,jaxserve-no-prefix-caching \\
        --workload ../shared/workloads/shared_prefix.jsonl --num-prompts 4 --max-output-len 8   # a smoke run

With `--busy-start` every server is measured twice: started on a quiet machine, and started while another
process keeps one core busy (`python -c "while True: pass"`, from before the server launches until it answers
/health), which is stopped before the client runs. The busy start's rows are named `<server> (busy start)`, and a
line per server and rate gives its output tok/s and mean TTFT over the quiet start's: a server must not keep
what it learned about its speed while the machine was busy (issue 57's check: within 10% of the quiet start's
output tok/s and 20% of its mean TTFT).

    python scripts/bench_serving.py --servers jaxserve --busy-start --num-prompts 32 --random-input-len 512 \\
        --random-output-len 64 --request-rate 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines  # noqa: E402  (standard library only: vLLM's location and settings)
from bench_prefix_caching import shared_prefix_requests  # noqa: E402
from plot_itl import write_itl_plot  # noqa: E402
from plot_load_sweep import write_sweep_plot  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"  # the name both servers answer to in --servers mode
DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "mixed_lengths.jsonl"
SOURCE_TEXT = (
    "The history of computing is a story of abstraction layered on abstraction: switches became gates, "
    "gates became arithmetic units, and programs learned to write other programs. "
)


@dataclasses.dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    wrong_length: bool = False  # the stream ended well, with another number of tokens than asked
    start_time: float = 0.0  # time.perf_counter() when sent
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)


async def served_model(client: httpx.AsyncClient) -> str:
    return (await client.get("/v1/models")).json()["data"][0]["id"]


def load_workload(args) -> list[dict]:
    """The first --num-prompts requests of --workload (all when --num-prompts is None), each output length
    capped at --max-output-len."""
    workload = [json.loads(line) for line in Path(args.workload).read_text().splitlines() if line.strip()]
    workload = workload[: args.num_prompts]
    if args.max_output_len:
        workload = [dict(r, output_len=min(r["output_len"], args.max_output_len)) for r in workload]
    return workload


def is_shared_prefix(workload: list[dict]) -> bool:
    return "prefix_id" in workload[0]


def vocab_size(args) -> int:
    """--vocab-size, else the embedded model's."""
    if args.vocab_size:
        return args.vocab_size
    from jaxserve.weights import load_config, resolve_model_path

    return load_config(resolve_model_path(None)).vocab_size


async def build_prompts(client: httpx.AsyncClient, workload: list[dict], args) -> list[list[int]]:
    """The workload's token-id prompts: shared prefix + own suffix, or windows of one tokenized text (where
    they start depends on --seed)."""
    if is_shared_prefix(workload):
        return [prompt for prompt, _ in shared_prefix_requests(workload, vocab_size(args))]
    if args.random_prompt_ids:
        return random_prompts(workload, vocab_size(args), args.seed)
    return await text_window_prompts(client, workload, args.seed)


def random_prompts(workload: list[dict], vocab: int, seed: int) -> list[list[int]]:
    """Seeded random token ids in [100, vocab), as `vllm bench serve`'s random dataset: no two prompts share a
    block, so no server's prefix cache serves any of them (text windows of a repeated text overlap)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, size=request["prompt_len"]).tolist() for request in workload]


async def text_window_prompts(client: httpx.AsyncClient, workload: list[dict], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of exactly each prompt_len: windows of one tokenized text."""
    longest = max(r["prompt_len"] for r in workload)
    text = SOURCE_TEXT
    ids: list[int] = []
    while len(ids) < 2 * longest:
        text += text
        ids = (await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})).json()["tokens"]
    prompts = []
    for i, request in enumerate(workload):
        start = (i * 37 + seed * 101) % (len(ids) - request["prompt_len"])
        prompts.append(ids[start : start + request["prompt_len"]])
    return prompts


async def sse_chunks(response: httpx.Response):
    """The JSON chunks of an OpenAI-style streamed response (server-sent events, without the final [DONE])."""
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))


async def send_request(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int,
                       sampling: dict | None = None) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **(sampling or {})}
    start = last = time.perf_counter()
    result = RequestResult(prompt_len=len(prompt), start_time=start)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = (await response.aread()).decode()
                return result
            async for chunk in sse_chunks(response):
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
        result.wrong_length = not result.ok
        if not result.ok:
            result.error = f"expected {output_len} tokens, got {result.output_len}"
    except httpx.HTTPError as err:
        result.error = f"{type(err).__name__}: {err}"
    return result


async def send_workload(args, base_url: str) -> tuple[list[RequestResult], float]:
    """Every request of the workload sent to base_url as --request-rate says; (results, seconds)."""
    workload = load_workload(args)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
        model = args.model or await served_model(client)
        prompts = await build_prompts(client, workload, args)
        rng = np.random.default_rng(args.seed)
        semaphore = asyncio.Semaphore(args.max_concurrency or len(workload))

        async def limited(prompt, output_len):
            async with semaphore:
                return await send_request(client, model, prompt, output_len, sampling_fields(args))

        tasks = []
        start = time.perf_counter()
        for prompt, request in zip(prompts, workload, strict=True):
            tasks.append(asyncio.create_task(limited(prompt, request["output_len"])))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return results, duration


def sampling_fields(args) -> dict:
    """The request's temperature (and top_p when given): greedy unless --temperature says otherwise."""
    return {"temperature": args.temperature, **({"top_p": args.top_p} if args.top_p is not None else {})}


async def run(args) -> dict:
    return summarize(*await send_workload(args, args.base_url))


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


# ----- --servers: start each server, measure it (`vllm bench serve` or our client), compare -------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PREFILL_OR_DECODE = "jaxserve-prefill-or-decode"  # jaxserve on the CPU grid without its [mixed] buckets
NO_PREFIX_CACHING = "jaxserve-no-prefix-caching"  # jaxserve with --no-enable-prefix-caching
JAXSERVE_SERVERS = ("jaxserve", PREFILL_OR_DECODE, NO_PREFIX_CACHING)


def server_command(args, server: str, port: int) -> tuple[list[str], dict]:
    """The command line and environment that serve the embedded model on 127.0.0.1:port."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(args.max_model_len),
              "--served-model-name", SERVED_MODEL_NAME]
    server, variant_args = split_variant(server)
    if server in JAXSERVE_SERVERS:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--dtype", args.dtype, *common,
               "--uvicorn-log-level", "warning"]
        if server == PREFILL_OR_DECODE:
            cmd += ["--buckets", str(prefill_or_decode_buckets(Path(args.result_dir)))]
        if server == NO_PREFIX_CACHING:
            cmd += ["--no-enable-prefix-caching"]
        return cmd + shlex.split(getattr(args, "jaxserve_args", "") or "") + variant_args, env
    if server == "vllm":
        cmd = [str(baselines.vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(baselines.embedded_hf_dir()), "--dtype", args.vllm_dtype, "--seed", "0", *common]
        return cmd, vllm_env(args)
    raise ValueError(f"unknown server {server!r} ({', '.join(JAXSERVE_SERVERS)} or vllm)")


def split_variant(server: str) -> tuple[str, list[str]]:
    """`jaxserve[--max-itl-ms 400]` -> ("jaxserve", ["--max-itl-ms", "400"]): a jaxserve server with more flags,
    named as written (so several variants run and compare in one run)."""
    name, bracket, rest = server.partition("[")
    if not bracket:
        return server, []
    if not rest.endswith("]") or name not in JAXSERVE_SERVERS:
        raise ValueError(f"a server variant is a jaxserve server with flags in brackets, got {server!r}")
    return name, shlex.split(rest[:-1])


def prefill_or_decode_buckets(directory: Path) -> Path:
    """The shipped CPU bucket file without its [mixed] table: jaxserve scheduling prefill-or-decode steps."""
    shipped = (REPO / "jaxserve" / "_buckets" / "cpu.toml").read_text()
    kept, skipping = [], False
    for line in shipped.splitlines():
        if line.startswith("["):
            skipping = line.split("#")[0].strip() == "[mixed]"
        if not skipping:
            kept.append(line)
    path = directory / "cpu-prefill-or-decode.toml"
    path.write_text("\n".join(kept) + "\n")
    return path


def vllm_env(args) -> dict:
    return baselines.vllm_env(args.vllm_kv_cache_gib, args.vllm_omp_bind, args.vllm_reserved_cpus)


def client_command(args, port: int, result_dir: Path, result_file: str) -> list[str]:
    """`vllm bench serve` against 127.0.0.1:port, its JSON result (with per-request lengths) saved."""
    return [
        str(baselines.vllm_bin()), "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
        "--model", SERVED_MODEL_NAME, "--tokenizer", str(baselines.embedded_hf_dir()),
        "--dataset-name", "random", "--random-input-len", str(args.random_input_len),
        "--random-output-len", str(args.random_output_len), "--ignore-eos", "--temperature", str(args.temperature),
        *(["--top-p", str(args.top_p)] if args.top_p is not None else []),
        "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate), "--seed", str(args.seed),
        *(["--max-concurrency", str(args.max_concurrency)] if args.max_concurrency else []),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", result_file,
    ]


def wait_ready(proc: subprocess.Popen, base_url: str, timeout: float) -> float:
    """Seconds until the server answers /health and /v1/models; raises if it exits or takes too long."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            if (httpx.get(base_url + "/health", timeout=5).status_code == 200
                    and httpx.get(base_url + "/v1/models", timeout=5).status_code == 200):
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"the server at {base_url} was not ready after {timeout:.0f}s")


def stop_server(proc: subprocess.Popen, grace: float = 60) -> None:
    """SIGTERM to the server (it shuts down the engine processes it forked), then SIGKILL to whatever of
    its process group is left."""
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # its own session (start_new_session): only what it started
    proc.wait()


BUSY_START = " (busy start)"  # a row's server name: started while another process kept one core busy


def start_busy_core() -> subprocess.Popen:
    """A process that keeps one core busy until it is killed (`stop_busy_core`)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)


def stop_busy_core(spinner: subprocess.Popen | None) -> None:
    if spinner is not None:
        spinner.kill()
        spinner.wait()


def measure_server(args, server: str, result_dir: Path, rates: list[float], busy_start: bool = False) -> list[dict]:
    """Starts `server` (with `busy_start`, while one core is kept busy until it is ready), runs the client against
    it once per request rate, stops it; the client's results, each with the server's time to ready and its prefix
    cache counters over that client run."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd, env = server_command(args, server, port)
    results = []
    label = server + (BUSY_START if busy_start else "")  # its rows' and files' name
    with open(result_dir / f"{file_stem(label)}-server.log", "w") as log:
        spinner = start_busy_core() if busy_start else None
        print(f"starting {label}: {' '.join(cmd)}", flush=True)
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
        try:
            try:
                ready = wait_ready(proc, base_url, args.server_timeout)
            except (RuntimeError, TimeoutError) as err:
                raise RuntimeError(f"{label}: {err}; its log: {log.name}") from err
            finally:
                stop_busy_core(spinner)  # the server is loaded on a quiet machine
            if args.request_rates and args.warmup_prompts:
                print(f"{label} ready after {ready:.0f}s; warming up with {args.warmup_prompts} prompts", flush=True)
                warmup = {"num_prompts": args.warmup_prompts, "seed": args.seed + WARMUP_SEED_OFFSET}
                run_client(argparse.Namespace(**{**vars(args), **warmup}), label, port, result_dir, float("inf"),
                           name=f"{file_stem(label)}-warmup.json")
            for i, rate in enumerate(rates):
                print(f"{label} ready after {ready:.0f}s; running {client_name(args)} at {rate} req/s", flush=True)
                before = prefix_cache_counters(base_url)
                # a sweep gives each rate its own prompts (seed + i), the same for every server: a rate must not
                # find the prompts of the rates before it in the prefix cache
                rate_args = argparse.Namespace(**{**vars(args), "seed": args.seed + i}) if args.request_rates else args
                result = run_client(rate_args, label, port, result_dir, rate)
                after = prefix_cache_counters(base_url)
                result["startup_s"] = ready
                result["prefix_cache"] = {name: after[name] - before[name] for name in after}
                results.append(result)
        finally:
            stop_server(proc)
    return results


def client_name(args) -> str:
    return f"this script's client on {args.workload}" if args.workload else "vllm bench serve"


WARMUP_SEED_OFFSET = 1000  # the warm-up run's prompts are none of the measured runs'


def run_client(args, server: str, port: int, result_dir: Path, rate: float, name: str | None = None) -> dict:
    """Our client when --workload is given, else `vllm bench serve`, at `rate`; its result, saved as `name`
    (default <server>.json; in a sweep <server>-rate<rate>.json)."""
    args = argparse.Namespace(**{**vars(args), "request_rate": rate})
    stem = file_stem(server)
    name = name or (f"{stem}-rate{rate:g}.json" if args.request_rates else f"{stem}.json")
    if args.workload:
        return own_client_result(args, f"http://127.0.0.1:{port}", result_dir / name)
    return vllm_client_result(args, port, result_dir, name)


def file_stem(server: str) -> str:
    """A server's name as a file name: a variant's flags may hold paths (`jaxserve[--buckets /tmp/b.toml]`)."""
    return re.sub(r"[^A-Za-z0-9._\[\]-]+", "_", server)


def vllm_client_result(args, port: int, result_dir: Path, result_file: str) -> dict:
    """`vllm bench serve` against the server; its saved JSON result."""
    with open(result_dir / f"{Path(result_file).stem}-client.log", "w") as client_log:
        subprocess.run(client_command(args, port, result_dir, result_file), env=vllm_env(args),
                       stdout=client_log, stderr=subprocess.STDOUT, check=True, cwd=result_dir,
                       timeout=args.client_timeout)
    return json.loads((result_dir / result_file).read_text())


def own_client_result(args, base_url: str, path: Path) -> dict:
    """This script's client on --workload, as a `vllm bench serve`-like result (the fields the table and the
    ITL plot read), also saved to `path`."""
    results, duration = asyncio.run(asyncio.wait_for(send_workload(args, base_url), args.client_timeout))
    result = summarize(results, duration)
    result.update({
        "completed": sum(r.ok for r in results), "wrong_length": sum(r.wrong_length for r in results),
        "failed": sum(not r.ok and not r.wrong_length for r in results),
        "start_times": [r.start_time for r in results if r.ok], "ttfts": [r.ttft for r in results if r.ok],
        "itls": [r.itl for r in results if r.ok],
    })
    path.write_text(json.dumps(result))
    return result


def prefix_cache_counters(base_url: str) -> dict:
    """The server's prefix cache counters from /metrics (jaxserve's and vLLM's `*prefix_cache_queries_total`,
    `*prefix_cache_hits_total`, summed over labels): {"queries", "hits"}, 0 where it has none."""
    counters = {"queries": 0.0, "hits": 0.0}
    try:
        text = httpx.get(base_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return counters
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.split("{")[0].split()[0], line.split()[-1]
        for key in counters:
            if name.endswith(f"prefix_cache_{key}_total"):
                counters[key] += float(value)
    return counters


def summarize_client_result(server: str, result: dict, output_len: int) -> dict:
    """One table row from `vllm bench serve`'s saved JSON (saved with --save-detailed) or our client's."""
    if "wrong_length" in result:  # our client's: counted per request against the workload's lengths
        short = result["wrong_length"]
    else:
        short = sum(1 for n in result.get("output_lens") or [] if n != output_len)
    return {
        "server": server, "completed": result["completed"], "failed": result["failed"],
        "wrong_length": short, "output_throughput": result["output_throughput"],
        **{key: result[key] for key in SERVING_METRICS}, "prefix_cache": result.get("prefix_cache"),
    }


SERVING_METRICS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "p99_itl_ms")


def comparison_table(rows: list[dict]) -> str:
    """Markdown: one row per server, then jaxserve's figures over vLLM's when both ran."""
    columns = ["output_throughput", *SERVING_METRICS]
    titles = ["output tok/s", "mean TTFT ms", "median TTFT ms", "P99 TTFT ms", "mean TPOT ms", "mean ITL ms",
              "P99 ITL ms"]
    lines = [f"| server | ok / failed / wrong length | {' | '.join(titles)} |",
             "|---|---|" + "---|" * len(titles)]
    for r in rows:
        figures = " | ".join(f"{r[c]:.1f}" for c in columns)
        lines.append(f"| {r['server']} | {r['completed']} / {r['failed']} / {r['wrong_length']} | {figures} |")
    by_name = {r["server"]: r for r in rows}
    if "vllm" in by_name:  # every jaxserve server over vLLM
        pairs = [(r, by_name["vllm"]) for r in rows if r["server"].startswith("jaxserve")]
    else:  # jaxserve over every other server
        pairs = [(by_name["jaxserve"], r) for r in rows if r["server"] != "jaxserve"] if "jaxserve" in by_name else []
    for mine, other in pairs:
        ratios = " | ".join(f"{mine[c] / other[c]:.2f}x" if other[c] else "n/a" for c in columns)
        lines.append(f"| {mine['server']} / {other['server']} | | {ratios} |")
    return "\n".join(lines)


def prefix_caching_lines(rows: list[dict]) -> list[str]:
    """Each server's prefix cache hits over queried tokens, and the median TTFT of jaxserve without prefix
    caching over jaxserve with it, when both ran."""
    hits = []
    for r in rows:
        counters = r.get("prefix_cache") or {}
        queries, found = counters.get("queries", 0), counters.get("hits", 0)
        hits.append(f"{r['server']} {found:.0f} / {queries:.0f}" + (f" ({found / queries:.1%})" if queries else ""))
    lines = ["prefix cache hits / queried tokens (server /metrics, over the client's run): " + ", ".join(hits)]
    by_name = {r["server"]: r for r in rows}
    if "jaxserve" in by_name and NO_PREFIX_CACHING in by_name:
        on, off = by_name["jaxserve"]["median_ttft_ms"], by_name[NO_PREFIX_CACHING]["median_ttft_ms"]
        ratio = f"{off / on:.2f}x" if on else "n/a"
        lines.append(f"median TTFT, no prefix caching / prefix caching: {ratio} ({off:.1f} ms / {on:.1f} ms)")
    return lines


def busy_start_lines(rows: list[dict]) -> list[str]:
    """Each busy start's output tok/s and mean TTFT over its quiet start's, against issue 57's bounds (10%, 20%)."""
    by_name = {r["server"]: r for r in rows}
    lines = []
    for busy in (r for r in rows if r["server"].endswith(BUSY_START)):
        quiet = by_name.get(busy["server"].removesuffix(BUSY_START))
        if quiet is None or not quiet["output_throughput"] or not quiet["mean_ttft_ms"]:
            continue
        tok_s = busy["output_throughput"] / quiet["output_throughput"]
        ttft = busy["mean_ttft_ms"] / quiet["mean_ttft_ms"]
        lines.append(f"{busy['server']} / quiet start: output tok/s {tok_s:.2f}x "
                     f"({'within' if tok_s >= 0.9 else 'outside'} 10%), mean TTFT {ttft:.2f}x "
                     f"({'within' if ttft <= 1.2 else 'outside'} 20%)")
    return lines


def compare_servers(args) -> None:
    result_dir = Path(args.result_dir or tempfile.mkdtemp(prefix="bench_serving_"))
    result_dir.mkdir(parents=True, exist_ok=True)
    args.result_dir = str(result_dir)
    baselines.embedded_hf_dir()  # converted before any server starts (vLLM's model, the client's tokenizer)
    rates = parse_rates(args.request_rates) if args.request_rates else [args.request_rate]
    rows, startups, results = [], [], []
    starts = [(server, busy) for server in filter(None, args.servers.split(","))
              for busy in ((False, True) if args.busy_start else (False,))]
    for server, busy in starts:
        label = server + (BUSY_START if busy else "")
        for rate, result in zip(rates, measure_server(args, server, result_dir, rates, busy), strict=True):
            results.append((label, result))
            rows.append({**summarize_client_result(label, result, args.random_output_len), "rate": rate})
            print(json.dumps(rows[-1]), flush=True)
        startups.append(f"{label} {results[-1][1]['startup_s']:.0f}s")
    print(f"\n{workload_description(args)}; jaxserve {args.dtype}, vLLM {args.vllm_dtype}; time to ready (not "
          f"measured): {', '.join(startups)}; logs and results in {result_dir}")
    if args.request_rates:
        report_sweep(args, rows, result_dir)
        return
    plot = Path(args.itl_plot) if args.itl_plot else result_dir / "itl_over_time.svg"
    write_itl_plot(plot, f"ITL over time: {workload_title(args)} at {args.request_rate} req/s", results)
    print(f"{args.request_rate} req/s; ITL over time: {plot}\n")
    print(comparison_table(rows))
    print("\n" + "\n".join(prefix_caching_lines(rows) + busy_start_lines(rows)))


def parse_rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise SystemExit(f"--request-rates: positive requests/s or inf, comma-separated; got {text!r}")
    return rates


def report_sweep(args, rows: list[dict], result_dir: Path) -> None:
    """One table per rate (each with jaxserve's ratios over the others), the rows as JSON and the TTFT / P99 ITL
    against rate plot."""
    (result_dir / "sweep.json").write_text(json.dumps(rows, indent=1))
    plot = Path(args.sweep_plot) if args.sweep_plot else result_dir / "load_sweep.svg"
    write_sweep_plot(plot, f"{workload_title(args)}: latency against load", rows)
    for rate in sorted({r["rate"] for r in rows}):
        print(f"\n### {rate:g} requests/s\n")
        print(comparison_table([r for r in rows if r["rate"] == rate]))
        print("\n".join(busy_start_lines([r for r in rows if r["rate"] == rate])))
    print(f"\nrows: {result_dir / 'sweep.json'}; plot: {plot}")


def workload_title(args) -> str:
    if args.workload:
        return f"{len(load_workload(args))} requests of {Path(args.workload).stem}"
    sampled = "" if not args.temperature else f", {sampling_description(args)}"
    return f"{args.num_prompts} x {args.random_input_len} -> {args.random_output_len} tokens{sampled}"


def workload_description(args) -> str:
    if args.workload:
        workload = load_workload(args)
        prompt = sum(r.get("prompt_len", 0) + r.get("prefix_len", 0) + r.get("suffix_len", 0) for r in workload)
        output = sum(r["output_len"] for r in workload)
        return (f"{len(workload)} requests of {args.workload} ({prompt} prompt tokens, {output} out, ignore_eos, "
                f"{sampling_description(args)}), this script's client")
    return (f"{args.num_prompts} prompts of {args.random_input_len} tokens, {args.random_output_len} out "
            f"(ignore_eos, {sampling_description(args)}), `vllm bench serve`")


def sampling_description(args) -> str:
    if not args.temperature:
        return "greedy"
    return f"temperature {args.temperature:g}" + (f", top_p {args.top_p:g}" if args.top_p is not None else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's)")
    parser.add_argument("--workload", default=None,
                        help="a workload file (default: mixed_lengths; with --servers: `vllm bench serve`'s random "
                        "dataset, a file here switches to this script's client)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="default 256; 64 with --servers (all of --workload with --servers and --workload)")
    parser.add_argument("--max-output-len", type=int, default=None, help="caps each request's output_len")
    parser.add_argument("--random-prompt-ids", action="store_true",
                        help="--workload prompts of seeded random token ids (default: windows of one repeated text, "
                        "which the prefix cache partly serves)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="token ids of shared-prefix prompts are below this (default: the embedded model's)")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="requests per second, Poisson arrivals; inf sends all at once (default inf; 2 with "
                        "--servers)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=None, help="every request's top_p (default: not sent)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default=None, help="also write the summary here")
    group = parser.add_argument_group("--servers: start and measure each server (`vllm bench serve` or our client)")
    group.add_argument("--servers", default=None,
                       help=f"comma-separated, run in this order: {', '.join(JAXSERVE_SERVERS)}, vllm; a jaxserve "
                       "server with more flags is written NAME[FLAGS], e.g. 'jaxserve[--max-itl-ms 400]'")
    group.add_argument("--itl-plot", default=None, help="SVG of ITL over time (default: in --result-dir)")
    group.add_argument("--request-rates", default=None,
                       help="a load sweep: comma-separated requests/s (inf: all at once), each server started once "
                       "and measured at every rate; a table per rate and --sweep-plot")
    group.add_argument("--warmup-prompts", type=int, default=8,
                       help="a sweep first sends this many prompts at once to each server, unmeasured (0: none)")
    group.add_argument("--sweep-plot", default=None, help="SVG of mean TTFT and P99 ITL against rate (default: in "
                       "--result-dir)")
    group.add_argument("--random-input-len", type=int, default=256)
    group.add_argument("--random-output-len", type=int, default=128)
    group.add_argument("--max-model-len", type=int, default=2048, help="both servers'")
    group.add_argument("--dtype", default="auto", help="jaxserve's (default: its default, auto)")
    group.add_argument("--jaxserve-args", default="", help="more arguments for `jaxserve serve`, one string")
    group.add_argument("--vllm-dtype", default="bfloat16")
    group.add_argument("--vllm-kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    group.add_argument("--vllm-omp-bind", default=baselines.VLLM_OMP_BIND,
                       help="VLLM_CPU_OMP_THREADS_BIND: cores for vLLM's OpenMP threads, auto or nobind")
    group.add_argument("--vllm-reserved-cpus", type=int, default=baselines.VLLM_RESERVED_CPUS,
                       help="VLLM_CPU_NUM_OF_RESERVED_CPU: cores kept back from the model by --vllm-omp-bind auto")
    group.add_argument("--busy-start", action="store_true",
                       help="measure each server twice: started quietly, and started while one core is kept busy "
                            "until it is ready")
    group.add_argument("--server-timeout", type=float, default=900, help="seconds for a server to become ready")
    group.add_argument("--client-timeout", type=float, default=3600, help="seconds for one client run")
    group.add_argument("--result-dir", default=None, help="servers' logs and clients' results (default: a temp dir)")
    args = parser.parse_args()
    if args.servers:
        args.num_prompts = args.num_prompts or (None if args.workload else 64)
        args.request_rate = 2.0 if args.request_rate is None else args.request_rate
        compare_servers(args)
        return
    args.num_prompts = args.num_prompts or 256
    args.workload = args.workload or str(DEFAULT_WORKLOAD)
    args.request_rate = float("inf") if args.request_rate is None else args.request_rate
    summary = asyncio.run(run(args))
    print_summary(summary)
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
