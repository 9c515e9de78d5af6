"""Where a workload's time goes: device seconds per bucket, with every step waited on.

Runs the requests of `bench_throughput.py` (exact prompt and output lengths from
shared/workloads/mixed_lengths.jsonl, greedy, ignore_eos) through `LLMEngine.step()` with synchronous
scheduling and blocks on each step's tokens, so each step's time is its own. Prints the total, the host
share, and per bucket: steps, seconds, milliseconds per step and the average number of real rows.

    python scripts/profile_steps.py --num-requests 64
    python scripts/profile_steps.py --num-requests 64 --attention-backend reference   # plain-XLA attention
    python scripts/profile_steps.py --num-requests 64 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's jaxserve, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_throughput import DEFAULT_WORKLOAD, add_requests, load_requests  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--buckets", default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized from the device's memory")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    args = parser.parse_args(argv)

    import jax

    from jaxserve import LLM

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, buckets=args.buckets,
              attention_backend=args.attention_backend, num_kv_blocks=args.num_kv_blocks)
    engine = llm.llm_engine
    engine.async_scheduling = False
    requests = load_requests(args.workload, args.num_requests, engine.model_config.vocab_size)
    add_requests(engine, requests)

    per_bucket = collections.defaultdict(lambda: [0, 0.0, 0])  # steps, seconds, real rows
    execute = engine.runner.execute

    def timed_execute(bucket, inputs, prev_tokens=None):
        start = time.perf_counter()
        output = execute(bucket, inputs, prev_tokens)
        jax.block_until_ready(output.tokens)
        record = per_bucket[bucket]
        record[0] += 1
        record[1] += time.perf_counter() - start
        record[2] += int((inputs.lengths > 0).sum())
        return output

    engine.runner.execute = timed_execute
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    total = time.perf_counter() - start
    device = sum(seconds for _, seconds, _ in per_bucket.values())
    print(f"{len(requests)} requests, {engine.config.dtype}, attention backend {engine.runner.backend.name}: "
          f"{total:.1f}s, "
          f"{sum(steps for steps, _, _ in per_bucket.values())} steps, host {total - device:.1f}s")
    print("| bucket | steps | seconds | ms/step | real rows/step |")
    print("|---|---|---|---|---|")
    for bucket, (steps, seconds, rows) in sorted(per_bucket.items(), key=lambda item: -item[1][1]):
        print(f"| {bucket} | {steps} | {seconds:.1f} | {1e3 * seconds / steps:.2f} | {rows / steps:.1f} |")


if __name__ == "__main__":
    main()
