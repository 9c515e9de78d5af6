"""Offline throughput: jaxserve's continuous batching against transformers' static batching, same run.

Requests come from shared/workloads/mixed_lengths.jsonl: prompts of exactly `prompt_len` seeded random
token ids and exactly `output_len` new tokens (ignore_eos), so both engines do the same work. Prints
output tokens/s, requests/s, the ratio, padding waste and KV usage, as a markdown table.

    python scripts/bench_throughput.py                      # all 256 requests, embedded model
    python scripts/bench_throughput.py --num-requests 64 --hf-batch-sizes 16
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "mixed_lengths.jsonl"


def load_requests(path: Path, num_requests: int, vocab_size: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:num_requests]
    return [(rng.integers(100, vocab_size, size=r["prompt_len"]).tolist(), r["output_len"]) for r in lines]


def add_requests(engine, requests: list[tuple[list[int], int]]) -> None:
    """Queues each (prompt tokens, output length) as a greedy request of exactly that many tokens."""
    from jaxserve import SamplingParams

    for i, (prompt, num_tokens) in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
        engine.add_request(f"bench-{i}", {"prompt_token_ids": prompt}, params)


def bench_jaxserve(args, requests) -> dict:
    from jaxserve import LLM

    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, buckets=args.buckets)
    startup = time.perf_counter() - start
    engine = llm.llm_engine
    peak_usage = 0.0

    start = time.perf_counter()
    add_requests(engine, requests)
    num_out = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_out += len(out.outputs[0].token_ids) if out.finished else 0
        peak_usage = max(peak_usage, engine.block_manager.usage)
    elapsed = time.perf_counter() - start
    assert num_out == sum(n for _, n in requests), "jaxserve produced the wrong number of tokens"
    return {
        "engine": "jaxserve", "seconds": elapsed, "startup_s": startup, "output_tokens": num_out,
        "padding_waste": engine.stats.padding_waste, "peak_kv_usage": peak_usage,
        "preemptions": engine.stats.num_preemptions,
    }


def bench_transformers(args, requests, batch_size: int) -> dict:
    import torch
    import transformers

    from jaxserve.weights import resolve_model_path

    path = resolve_model_path(args.model)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    root = path.parent if path.suffix == ".gguf" else path
    model = transformers.AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32, **kwargs).eval()
    pad_id = 0
    num_out, padded = 0, 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        new_tokens = max(n for _, n in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        with torch.no_grad():
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=pad_id,
            )
        num_out += sum(n for _, n in batch)  # useful tokens: what each request asked for
        padded += len(batch) * (width + new_tokens)
    elapsed = time.perf_counter() - start
    real = sum(len(p) + n for p, n in requests)
    return {
        "engine": f"transformers (static batch {batch_size})", "seconds": elapsed, "output_tokens": num_out,
        "padding_waste": (padded - real) / real,
    }


def report(results: list[dict], num_requests: int) -> str:
    baseline = max((r for r in results if r["engine"].startswith("transformers")),
                   key=lambda r: r["output_tokens"] / r["seconds"], default=None)
    lines = [
        "| engine | seconds | output tok/s | requests/s | ratio to best transformers | padding waste |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        tps = r["output_tokens"] / r["seconds"]
        ratio = f"{tps / (baseline['output_tokens'] / baseline['seconds']):.2f}x" if baseline else "n/a"
        lines.append(
            f"| {r['engine']} | {r['seconds']:.1f} | {tps:.1f} | {num_requests / r['seconds']:.2f} | "
            f"{ratio} | {r['padding_waste']:.3f} |"
        )
    jax_result = next(r for r in results if r["engine"] == "jaxserve")
    lines.append("")
    lines.append(
        f"jaxserve: start-up (load + warm-up) {jax_result['startup_s']:.1f}s, peak KV usage "
        f"{jax_result['peak_kv_usage']:.1%}, preemptions {jax_result['preemptions']}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--buckets", default=None)
    parser.add_argument("--hf-batch-sizes", default="8,16,32", help="comma-separated; empty to skip")
    args = parser.parse_args()

    from jaxserve.weights import load_config, resolve_model_path

    vocab = load_config(resolve_model_path(args.model)).vocab_size
    requests = load_requests(args.workload, args.num_requests, vocab)
    results = [bench_jaxserve(args, requests)]
    print(json.dumps(results[-1]), flush=True)  # each engine's figures as soon as they exist
    for size in filter(None, args.hf_batch_sizes.split(",")):
        results.append(bench_transformers(args, requests, int(size)))
        print(json.dumps(results[-1]), flush=True)
    print(report(results, len(requests)))


if __name__ == "__main__":
    main()
