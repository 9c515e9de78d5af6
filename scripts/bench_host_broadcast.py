"""The per-step cost of multi-host serving's broadcast: host 0 sends each device call of its engine to the other
hosts over ZeroMQ before making it (`jaxserve/replication/serving_hosts.py`). Measured: the bytes of each call,
host 0's time to encode and send them, and how long after the send a follower holds the decoded call, against
the step time of the same run.

    python scripts/bench_host_broadcast.py [--requests 48] [--max-num-seqs 16] [--out results.json]
    python scripts/bench_host_broadcast.py --codec-only    # encoding and decoding a step's call, idle

Two processes on this machine (2 CPU devices each, `jax.distributed` on 127.0.0.1, tensor parallel 4 across them),
a random Llama of SmolLM2-135M's size (30 layers, vocabulary 49152) with 8 heads and 4 KV heads so that 4 devices
divide them. Requests: the first `--requests` of `../shared/workloads/mixed_lengths.jsonl` (prompts of seeded
token ids, `output_len` tokens each, lengths capped to fit max_model_len 1024; every other one sampled at temperature
0.8, top_p 0.95, so that its sampler slot is written). Host 0 drives its engine with
`step()` (the server's loop without HTTP), process 1 follows (`serving_hosts.follow`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's jaxserve, not an installed one
from jaxserve.testing.ports import free_port  # noqa: E402

WORKLOAD = ROOT.parent / "shared" / "workloads" / "mixed_lengths.jsonl"
MAX_MODEL_LEN = 1024


def random_model(path: Path) -> Path:
    """SmolLM2-135M's size with 8 heads of 64 and 4 KV heads (`bench_draft_bounds.random_smollm2`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_draft_bounds import random_smollm2

    return Path(random_smollm2(str(path), hidden_size=512, num_attention_heads=8, num_key_value_heads=4))


def workload(num: int) -> list[tuple[list[int], int]]:
    import numpy as np

    requests = []
    for line in WORKLOAD.read_text().splitlines()[:num]:
        item = json.loads(line)
        output_len = min(item["output_len"], 256)
        prompt_len = min(item["prompt_len"], MAX_MODEL_LEN - output_len)
        rng = np.random.default_rng(item["id"])
        requests.append((rng.integers(3, 49152, prompt_len).tolist(), output_len))
    return requests


# ----- the two processes -----------------------------------------------------------------------------------------
def run_host(model: str, args, out: Path) -> None:
    import jax

    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.distributed import host_links
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.replication import serving_hosts
    from jaxserve.sampling_params import SamplingParams

    config = EngineConfig(model=model, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=args.max_num_seqs,
                          tensor_parallel_size=4, distributed_init=True, compile_cache_dir=args.compile_cache_dir,
                          disable_log_stats=True)
    engine = LLMEngine(config)
    records: list = []
    if jax.process_index() == 0:
        record_sends(host_links.LeaderLinks, records)
        host = serving_hosts.lead(engine)
        steps = drive(engine, workload(args.requests), SamplingParams)
        host.stop()
        result = {"calls": records, "steps": steps, "stats": vars(host.stats())}
    else:
        record_receipts(serving_hosts.step_messages, records)
        serving_hosts.follow(engine)
        result = {"calls": records}
    out.write_text(json.dumps(result))


def record_sends(links_class, records: list) -> None:
    """When host 0 sent each call (queued on its socket), and its bytes."""
    send = links_class.send

    def timed_send(self, payload: bytes) -> None:
        send(self, payload)
        records.append([time.time(), len(payload)])

    links_class.send = timed_send


def record_receipts(step_messages, records: list) -> None:
    """When the follower holds each decoded call (`follow` looks `step_messages.decode` up at each call)."""
    decode = step_messages.decode

    def timed_decode(payload, handles):
        message = decode(payload, handles)
        records.append([time.time(), message[1]])
        return message

    step_messages.decode = timed_decode


def drive(engine, requests, sampling_params_class) -> list[float]:
    """Adds every request, then steps until all finish; each step's wall time."""
    for i, (prompt, output_len) in enumerate(requests):  # every other request sampled: its sampler slot is reset
        sampled = {"temperature": 0.8, "top_p": 0.95, "seed": i} if i % 2 else {"temperature": 0.0}
        params = sampling_params_class(max_tokens=output_len, ignore_eos=True, **sampled)
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    steps = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    return steps


def codec_microseconds(batch_size: int, repeats: int = 1000) -> dict:
    """Encoding and decoding one decode step's call of ``batch_size`` rows alone, on an idle process (the run's own
    figures include waiting for the cores its devices keep busy)."""
    import numpy as np

    from jaxserve.core.buckets import DecodeBucket
    from jaxserve.replication.step_messages import OutputHandles, decode, encode
    from jaxserve.runner.input_batch import StepInputs
    from jaxserve.runner.sampler import SamplingTensors

    rng, s = np.random.default_rng(0), batch_size
    sampling = SamplingTensors(rng.random((s, 6), np.float32), rng.integers(0, 9, (s, 8), np.int32),
                               np.full((s, 49152 // 32), -1, np.int32))
    rows = np.arange(s, dtype=np.int32)
    block_tables = rng.integers(0, 4096, (s, MAX_MODEL_LEN // 16), np.int32)
    inputs = StepInputs(rng.integers(0, 49152, (s, 1), np.int32), block_tables, rows, rows + 100,
                        np.zeros(s, np.int32), sampling, feed_rows=rows, feed_cols=rows * 0)
    message = ["target", "execute", [DecodeBucket(s, MAX_MODEL_LEN), inputs, None]]
    started = time.perf_counter()
    for _ in range(repeats):
        payload = encode(message, OutputHandles())
    encoded = time.perf_counter()
    for _ in range(repeats):
        decode(payload, OutputHandles())
    decoded = time.perf_counter()
    return {"batch_size": s, "bytes": len(payload), "encode_us": 1e6 * (encoded - started) / repeats,
            "decode_us": 1e6 * (decoded - encoded) / repeats}


# ----- the parent ------------------------------------------------------------------------------------------------
def launch(model: Path, args, work: Path) -> list[dict]:
    port, procs = free_port(), []
    for process_id in range(2):
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
               "JAXSERVE_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAXSERVE_NUM_PROCESSES": "2",
               "JAXSERVE_PROCESS_ID": str(process_id), "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, __file__, "--host", str(model), str(work / f"host{process_id}.json"),
               "--requests", str(args.requests), "--max-num-seqs", str(args.max_num_seqs),
               "--compile-cache-dir", args.compile_cache_dir]
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [proc.wait() for proc in procs]
    if any(codes):
        raise SystemExit(f"a host failed: exit codes {codes}")
    return [json.loads((work / f"host{i}.json").read_text()) for i in range(2)]


def summarize(leader: dict, follower: dict) -> dict:
    sends, receipts, steps = leader["calls"], follower["calls"], leader["steps"]
    lags = sorted(1e6 * (got - sent) for (sent, _), (got, _) in zip(sends, receipts, strict=True))
    methods = {}
    for (_, size), (_, method) in zip(sends, receipts, strict=True):
        methods.setdefault(method, []).append(size)
    stats = leader["stats"]
    step_s = statistics.median(steps)
    return {
        "steps": len(steps),
        "calls": stats["num_calls"],
        "calls_per_step": stats["num_calls"] / len(steps),
        "bytes_per_step": stats["num_bytes"] / len(steps),
        "bytes_per_call": {m: {"calls": len(s), "mean": statistics.mean(s), "max": max(s)} for m, s in methods.items()},
        "host0_encode_send_us_per_step": 1e6 * stats["seconds"] / len(steps),
        "follower_lag_us": {"p50": lags[len(lags) // 2], "p99": lags[int(0.99 * (len(lags) - 1))], "max": lags[-1]},
        "step_ms_median": 1e3 * step_s,
        "host0_cost_fraction_of_step": stats["seconds"] / len(steps) / step_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--compile-cache-dir", default="")
    parser.add_argument("--codec-only", action="store_true", help="only the idle encode/decode figures")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--host", nargs=2, metavar=("MODEL", "OUT_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.host:
        run_host(args.host[0], args, Path(args.host[1]))
        return
    summary = {}
    if not args.codec_only:
        with tempfile.TemporaryDirectory(prefix="bench-host-broadcast-") as tmp:
            work = Path(tmp)
            model = random_model(work / "model")
            started = time.perf_counter()
            leader, follower = launch(model, args, work)
        summary = summarize(leader, follower)
        summary["wall_s"] = time.perf_counter() - started
    summary["codec_idle"] = [codec_microseconds(s) for s in (1, 16, 64, 256)]
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
