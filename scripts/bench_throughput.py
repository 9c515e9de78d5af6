"""Offline throughput: jaxserve's continuous batching against baselines on the same requests, same run:
transformers' static batching and vLLM's CPU build (`LLM.generate`).

Requests come from shared/workloads/mixed_lengths.jsonl: prompts of exactly `prompt_len` seeded random
token ids and exactly `output_len` new tokens (greedy, ignore_eos), so every engine does the same work;
each engine is checked to have produced exactly `output_len` tokens for every request. Each engine is
measured in a fresh process of its own; start-up (load, warm-up, compilation) is not counted, only the
generation. Prints a markdown table: seconds, output tokens/s, requests/s, jaxserve's throughput over
each engine's ("jaxserve / it", above 1 means jaxserve is faster), padded tokens per real token, and
jaxserve's KV usage.

    python scripts/bench_throughput.py                      # all 256 requests, embedded model, transformers
    python scripts/bench_throughput.py --num-requests 64 --hf-batch-sizes 16
    python scripts/bench_throughput.py --baseline vllm      # vLLM bfloat16 on the same requests
    python scripts/bench_throughput.py --baseline transformers,vllm --vllm-dtype bfloat16,float32
    python scripts/bench_throughput.py --model DIR --dtype bfloat16 --buckets gpu --hf-dtype bfloat16 \
        --hf-device cuda --hf-batch-sizes 64          # on a GPU machine: both engines on the GPU
    python scripts/bench_throughput.py --baseline "" --quantization int8,int8_w8a8   # quantized against not
    python scripts/bench_throughput.py --baseline vllm --quantization int8_w8a8 --vllm-quantization int8_w8a8
    python scripts/bench_throughput.py --baseline "" --num-requests 128 --async-scheduling on,off,on,off
    python scripts/bench_throughput.py --baseline "" --num-requests 64 --max-model-len 8192 \
        --bucket-runs /tmp/old-cpu.toml,cpu,/tmp/old-cpu.toml,cpu    # two bucket grids, interleaved

`--baseline` is a comma-separated list of transformers (static batches of each `--hf-batch-sizes`, in each
`--hf-dtype`) and vllm (one run per `--vllm-dtype`); default transformers, empty for jaxserve alone. vLLM
runs from its own virtualenv (shared/tools/install_vllm_cpu.sh; see scripts/baselines.py), fed the embedded model
dequantized to a float32 safetensors directory (cached under ~/.cache/jaxserve-baselines/), with
`--max-model-len`, a KV cache of `--vllm-kv-cache-gib` GiB and its OpenMP threads bound as
`--vllm-omp-bind` says. Only the embedded model is supported with vllm (`--model` must be left out).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's jaxserve, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines  # noqa: E402  (standard library only: vLLM's location and settings)

DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "mixed_lengths.jsonl"


def load_requests(path: Path, num_requests: int, vocab_size: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:num_requests]
    return [(rng.integers(100, vocab_size, size=r["prompt_len"]).tolist(), r["output_len"]) for r in lines]


def add_requests(engine, requests: list[tuple[list[int], int]]) -> None:
    """Queues each (prompt tokens, output length) as a greedy request of exactly that many tokens, reported once
    finished (as `LLM.generate` asks, and vLLM's offline benchmark)."""
    from jaxserve import SamplingParams
    from jaxserve.sampling_params import RequestOutputKind

    for i, (prompt, num_tokens) in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        engine.add_request(f"bench-{i}", {"prompt_token_ids": prompt}, params)


def bench_jaxserve(args, requests, quantization: str | None = None, kv_cache_dtype: str = "auto",
                   async_scheduling: bool | None = None, buckets: str | None = None) -> dict:
    """One jaxserve run; ``buckets``: a bucket spec other than ``--buckets`` (a `--bucket-runs` entry)."""
    import jax

    from jaxserve import LLM

    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, buckets=buckets or args.buckets,
              num_kv_blocks=args.num_kv_blocks, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
              async_scheduling=async_scheduling)
    startup = time.perf_counter() - start
    engine = llm.llm_engine
    peak_usage = 0.0

    start = time.perf_counter()
    add_requests(engine, requests)
    counts: dict[int, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                counts[int(out.request_id.removeprefix("bench-"))] = len(out.outputs[0].token_ids)
        peak_usage = max(peak_usage, engine.block_manager.usage)
    elapsed = time.perf_counter() - start
    check_token_counts("jaxserve", [counts.get(i, 0) for i in range(len(requests))], requests)
    kv_label = "" if kv_cache_dtype == "auto" else f"{kv_cache_dtype} KV"
    async_label = {None: "", True: "async scheduling on", False: "async scheduling off"}[async_scheduling]
    buckets_label = "" if buckets is None else f"buckets {buckets}"
    return {
        "engine": " ".join(filter(None, ["jaxserve", quantization, kv_label, async_label, buckets_label])),
        "seconds": elapsed,
        "startup_s": startup, "output_tokens": sum(counts.values()),
        "padding_per_real_token": engine.stats.padding_per_real_token, "peak_kv_usage": peak_usage,
        "preemptions": engine.stats.num_preemptions, "num_executables": engine.grid.num_executables,
        "weight_bytes": sum(leaf.nbytes for leaf in jax.tree.leaves(engine.runner.params)),
        "kv_blocks": engine.grid.num_blocks,
    }


def async_scheduling_runs(text: str) -> list[bool]:
    """`--async-scheduling`'s comma-separated on/off values, in order (repeats allowed: on,off,on,off alternates)."""
    values = [value.strip() for value in text.split(",") if value.strip()]
    unknown = sorted(set(values) - {"on", "off"})
    if unknown:
        raise ValueError(f"--async-scheduling takes on and off, comma-separated; got {unknown}")
    return [value == "on" for value in values]


def bench_transformers(args, requests, batch_size: int, dtype: str) -> dict:
    import torch
    import transformers

    from jaxserve.weights import resolve_model_path

    path = resolve_model_path(args.model)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    root = path.parent if path.suffix == ".gguf" else path
    model = transformers.AutoModelForCausalLM.from_pretrained(str(root), dtype=getattr(torch, dtype), **kwargs)
    model = model.to(args.hf_device).eval()
    pad_id = 0
    num_out, padded = 0, 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        new_tokens = max(n for _, n in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch], device=args.hf_device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=args.hf_device)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=pad_id,
            )
        # every row runs to the batch's longest output: each request gets at least the tokens it asked for
        check_token_counts("transformers", [out.shape[1] - width] * len(batch), [(p, new_tokens) for p, _ in batch])
        num_out += sum(n for _, n in batch)  # useful tokens: what each request asked for
        padded += len(batch) * (width + new_tokens)
    elapsed = time.perf_counter() - start
    real = sum(len(p) + n for p, n in requests)
    return {
        "engine": f"transformers {dtype} on {args.hf_device} (static batch {batch_size})", "seconds": elapsed,
        "output_tokens": num_out,
        "padding_per_real_token": (padded - real) / real,
    }


def bench_vllm(args, requests, dtype: str, quantization: str | None = None) -> dict:
    """vLLM on the embedded model, or on it written as a compressed-tensors checkpoint of `quantization` (the
    values jaxserve's scheme computes: `jaxserve.weights.compressed_tensors`; vLLM serves int8 W8A8 on x86 CPUs)."""
    env = baselines.vllm_env(args.vllm_kv_cache_gib, args.vllm_omp_bind, args.vllm_reserved_cpus)
    model = None if quantization is None else quantized_embedded_dir(quantization)
    result = baselines.run_vllm_offline(requests, dtype=dtype, max_model_len=args.max_model_len, env=env, model=model)
    if quantization is not None:
        result["engine"] += f" {quantization} (compressed-tensors)"
    return result


def quantized_embedded_dir(quantization: str) -> Path:
    """The embedded model as a compressed-tensors checkpoint of `quantization`, written once into the baselines'
    cache."""
    from jaxserve.weights.compressed_tensors import write_compressed_tensors

    out = baselines.BASELINES_DIR / f"SmolLM2-135M-Instruct-{quantization}-compressed-tensors"
    if not (out / "config.json").is_file():
        write_compressed_tensors(baselines.embedded_hf_dir(), out, quantization)
    return out


def check_token_counts(engine: str, counts: list[int], requests: list[tuple[list[int], int]]) -> None:
    """Every request produced exactly the tokens it asked for."""
    wrong = [(i, got, n) for i, (got, (_, n)) in enumerate(zip(counts, requests, strict=True)) if got != n]
    assert not wrong, f"{engine} produced the wrong number of tokens (request, got, asked): {wrong[:5]}"


def in_fresh_process(fn, *args):
    """fn(*args) in a new Python process: each engine starts from nothing (no jax, torch or caches of
    the one before) and gives all its memory back when done."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


def report(results: list[dict], num_requests: int) -> str:
    jax_result = next(r for r in results if r["engine"] == "jaxserve")  # the unquantized run
    jax_tps = jax_result["output_tokens"] / jax_result["seconds"]
    lines = [
        "| engine | seconds | output tok/s | requests/s | jaxserve / it | padding per real token |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        tps = r["output_tokens"] / r["seconds"]
        padding = f"{r['padding_per_real_token']:.3f}" if "padding_per_real_token" in r else "n/a"
        lines.append(
            f"| {r['engine']} | {r['seconds']:.1f} | {tps:.1f} | {num_requests / r['seconds']:.2f} | "
            f"{jax_tps / tps:.2f}x | {padding} |"
        )
    lines.append("")
    for r in results:
        if r["engine"].startswith("jaxserve"):
            lines.append(
                f"{r['engine']}: start-up (load + warm-up) {r['startup_s']:.1f}s, {r['num_executables']} step "
                f"executables, weights "
                f"{r['weight_bytes'] / 1e6:.1f} MB, KV pool {r['kv_blocks']} blocks, peak KV usage "
                f"{r['peak_kv_usage']:.1%}, preemptions {r['preemptions']}"
            )
    for r in results:
        if r["engine"].startswith("vllm"):
            lines.append(f"{r['engine']}: start-up (load + compile + warm-up) {r['startup_s']:.1f}s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto", help="jaxserve's (default: its default, auto)")
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--buckets", default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="jaxserve's KV pool in blocks (default: sized from the device's memory; CPU: fixed)")
    parser.add_argument("--quantization", default="",
                        help="comma-separated schemes (int8, int8_w8a8, fp8, gguf): one more jaxserve run for each, "
                        "against the unquantized one")
    parser.add_argument("--kv-cache-dtypes", default="",
                        help="comma-separated KV cache dtypes (fp8): one more jaxserve run for each (float weights)")
    parser.add_argument("--async-scheduling", default="",
                        help="comma-separated on/off (repeats allowed, e.g. on,off,on,off): one more jaxserve run "
                        "for each, with async scheduling on or off (the first run takes the platform's default)")
    parser.add_argument("--bucket-runs", default="",
                        help="comma-separated bucket specs (names or .toml paths; repeats allowed, e.g. old.toml,cpu,"
                        "old.toml,cpu to interleave): one more jaxserve run for each, on that grid")
    parser.add_argument("--baseline", default="transformers",
                        help="comma-separated: transformers, vllm (default transformers; empty for none)")
    parser.add_argument("--hf-batch-sizes", default="8,16,32", help="transformers': comma-separated; empty to skip")
    parser.add_argument("--hf-dtype", default="float32", help="transformers': comma-separated torch dtypes")
    parser.add_argument("--hf-device", default="cpu", help="transformers' torch device (cuda on a GPU machine)")
    parser.add_argument("--vllm-dtype", default="bfloat16", help="comma-separated: one vLLM run for each")
    parser.add_argument("--vllm-quantization", default="",
                        help="comma-separated schemes: one more vLLM run (first --vllm-dtype) for each, on the embedded"
                        " model written as a compressed-tensors checkpoint of it (int8_w8a8: vLLM's CPU int8 path)")
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-omp-bind", default=baselines.VLLM_OMP_BIND,
                        help="VLLM_CPU_OMP_THREADS_BIND: cores for vLLM's OpenMP threads, auto or nobind")
    parser.add_argument("--vllm-reserved-cpus", type=int, default=baselines.VLLM_RESERVED_CPUS,
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU: cores kept back from the model by --vllm-omp-bind auto")
    args = parser.parse_args()
    chosen = set(filter(None, args.baseline.split(",")))
    if chosen - {"transformers", "vllm"}:
        parser.error(f"unknown --baseline {sorted(chosen - {'transformers', 'vllm'})}")
    if "vllm" in chosen and args.model is not None:
        parser.error("--baseline vllm runs the embedded model only: leave out --model")
    try:
        async_runs = async_scheduling_runs(args.async_scheduling)
    except ValueError as error:
        parser.error(str(error))

    from jaxserve.weights import load_config, resolve_model_path

    vocab = load_config(resolve_model_path(args.model)).vocab_size
    requests = load_requests(args.workload, args.num_requests, vocab)
    runs = [(bench_jaxserve, args, requests)]
    runs += [(bench_jaxserve, args, requests, scheme) for scheme in filter(None, args.quantization.split(","))]
    runs += [(bench_jaxserve, args, requests, None, kv) for kv in filter(None, args.kv_cache_dtypes.split(","))]
    runs += [(bench_jaxserve, args, requests, None, "auto", on) for on in async_runs]
    runs += [(bench_jaxserve, args, requests, None, "auto", None, spec)
             for spec in filter(None, args.bucket_runs.split(","))]
    if "transformers" in chosen:
        sizes = [int(size) for size in filter(None, args.hf_batch_sizes.split(","))]
        dtypes = filter(None, args.hf_dtype.split(","))
        runs += [(bench_transformers, args, requests, size, dtype) for dtype in dtypes for size in sizes]
    if "vllm" in chosen:
        dtypes = list(filter(None, args.vllm_dtype.split(",")))
        runs += [(bench_vllm, args, requests, dtype) for dtype in dtypes]
        runs += [(bench_vllm, args, requests, dtypes[0], scheme)
                 for scheme in filter(None, args.vllm_quantization.split(","))]
    results = []
    for fn, *fn_args in runs:
        results.append(in_fresh_process(fn, *fn_args))
        print(json.dumps(results[-1]), flush=True)  # each engine's figures as soon as they exist
    print(report(results, len(requests)))


if __name__ == "__main__":
    main()
