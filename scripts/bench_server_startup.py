"""Launch to first answer of `jaxserve serve` and `vllm serve`, cold and warm, in the same run.

    python scripts/bench_server_startup.py                       # jaxserve and vLLM, cold then warm each
    python scripts/bench_server_startup.py --servers jaxserve --repeats 2
    python scripts/bench_server_startup.py --busy-core            # each start beside a process spinning one core

Each server serves the embedded SmolLM2 (vLLM its float32 safetensors conversion, `baselines.embedded_hf_dir()`)
on 127.0.0.1 at `--max-model-len`. A start is timed from `Popen` to the first `/v1/completions` answer (one
greedy token), polled every 0.2 s; the time `/health` first answered 200 is reported beside it. "cold": an empty
cache directory (jaxserve's `--compile-cache-dir`, vLLM's `VLLM_CACHE_ROOT`, which holds its torch.compile
cache); "warm": a second start on the same directory. The kernel's page cache is warm for both (the weights were
read before). `--busy-core` runs `python -c "while True: pass"` beside each start until the first answer.
Output: a markdown table (and `--json` a file), for docs/benchmarks/startup.md.
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

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines  # noqa: E402
from bench_serving import SERVED_MODEL_NAME, free_port, server_command, start_busy_core, stop_busy_core  # noqa: E402

POLL_SECONDS = 0.2


def first_answer(proc: subprocess.Popen, base_url: str, launched: float, timeout: float) -> dict:
    """Seconds from ``launched`` until /health answered 200 and until a completion answered."""
    health = None
    body = {"model": SERVED_MODEL_NAME, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    while time.perf_counter() - launched < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering")
        try:
            if health is None and httpx.get(base_url + "/health", timeout=2).status_code == 200:
                health = time.perf_counter() - launched
            if health is not None:
                reply = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
                if reply.status_code == 200:
                    return {"health_s": health, "first_answer_s": time.perf_counter() - launched}
        except httpx.HTTPError:
            pass
        time.sleep(POLL_SECONDS)
    raise TimeoutError(f"no answer within {timeout} s")


def start_once(args, server: str, cache_dir: Path, log: Path) -> dict:
    port = free_port()
    cmd, env = server_command(args, server, port)
    if server == "vllm":
        env["VLLM_CACHE_ROOT"] = str(cache_dir)
    else:
        cmd += ["--compile-cache-dir", str(cache_dir)]
    busy = start_busy_core() if args.busy_core else None
    with log.open("w") as out:
        launched = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            return first_answer(proc, f"http://127.0.0.1:{port}", launched, args.timeout)
        finally:
            stop_busy_core(busy)
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="jaxserve,vllm", help="comma-separated: jaxserve, vllm")
    parser.add_argument("--max-model-len", type=int, default=8192, help="8192: the model's own, both servers' default")
    parser.add_argument("--dtype", default="auto", help="jaxserve's --dtype")
    parser.add_argument("--vllm-dtype", default="bfloat16")
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=4)
    parser.add_argument("--vllm-omp-bind", default=baselines.VLLM_OMP_BIND)
    parser.add_argument("--vllm-reserved-cpus", type=int, default=baselines.VLLM_RESERVED_CPUS)
    parser.add_argument("--jaxserve-args", default="", help="more flags for jaxserve serve")
    parser.add_argument("--repeats", type=int, default=1, help="cold+warm pairs per server")
    parser.add_argument("--busy-core", action="store_true", help="a process spins one core during each start")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--result-dir", default=None, help="server logs (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    args.result_dir = args.result_dir or tempfile.mkdtemp(prefix="bench_server_startup_")
    result_dir = Path(args.result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for repeat in range(args.repeats):
        for server in args.servers.split(","):
            cache_dir = Path(tempfile.mkdtemp(prefix=f"cache-{server}-", dir=result_dir))
            for kind in ("cold", "warm"):
                log = result_dir / f"{server}-{kind}-{repeat}.log"
                row = {"server": server, "start": kind, "repeat": repeat,
                       **start_once(args, server, cache_dir, log)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"logs in {result_dir}")


def print_table(rows: list[dict]) -> None:
    print("\n| server | start | /health 200 s | first answer s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['server']} | {r['start']} | {r['health_s']:.1f} | {r['first_answer_s']:.1f} |")
    by = {}
    for r in rows:
        by.setdefault((r["server"], r["start"]), []).append(r["first_answer_s"])
    for kind in ("cold", "warm"):
        if ("jaxserve", kind) in by and ("vllm", kind) in by:
            ours, theirs = min(by[("jaxserve", kind)]), min(by[("vllm", kind)])
            print(f"\n{kind}: jaxserve / vllm = {ours / theirs:.2f} (best of each)")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
