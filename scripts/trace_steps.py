"""Summarizes a step trace (`JAXSERVE_STEP_TRACE=trace.jsonl jaxserve serve ...`): where the inter-token
latency of a server's decoding streams goes, step kind by step kind and bucket by bucket.

Each completed step closes a gap since the step before it (`ready` minus the previous `ready`): a stream with a
row in that step waited that long for its token. Counting only steps with decode rows, weighted by their decode
rows, gives the inter-token latencies the engine handed out, so the table's P99 is comparable to a benchmark
client's P99 ITL (minus the HTTP path). Prints a markdown table per (kind, bucket) and the largest gaps.

    JAXSERVE_STEP_TRACE=/tmp/trace.jsonl jaxserve serve --port 8000 &
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 ...   # or any client
    python scripts/trace_steps.py /tmp/trace.jsonl --top 10
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np


def read_trace(path: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(records, key=lambda r: r["ready"])


def with_gaps(records: list[dict], idle_s: float) -> list[dict]:
    """Each record gains `gap_s`: since the previous step's tokens were ready. A step launched more than `idle_s`
    after that (the engine had nothing to do) is measured from its own launch instead."""
    for previous, record in zip([None, *records], records, strict=False):
        start = record["launched"]
        if previous is not None and record["launched"] - previous["ready"] <= idle_s:
            start = previous["ready"]
        record["gap_s"] = record["ready"] - start
    return records


def bucket_name(record: dict) -> str:
    bucket = record["bucket"]
    if record["kind"] == "mixed":
        return f"mixed {bucket['num_tokens']} tok x {bucket['batch_size']} rows"
    if record["kind"] == "prefill":
        return f"prefill {bucket['batch_size']} x {bucket['chunk_len']}"
    return f"decode batch {bucket['batch_size']}"


def summary_table(records: list[dict]) -> str:
    groups: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        groups[bucket_name(record)].append(record)
    all_itls = _itls(records)
    lines = [
        "| step | steps | mean decode rows | mean prefill tokens | mean gap ms | P99 gap ms | share of ITLs | "
        "share of ITLs above the overall P99 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    p99 = float(np.percentile(all_itls, 99)) if len(all_itls) else 0.0
    for name, group in sorted(groups.items(), key=lambda item: -len(item[1])):
        gaps = np.array([r["gap_s"] for r in group]) * 1e3
        itls = _itls(group)
        lines.append(
            f"| {name} | {len(group)} | {np.mean([r['decode_rows'] for r in group]):.1f} | "
            f"{np.mean([r['prefill_tokens'] for r in group]):.0f} | {gaps.mean():.1f} | "
            f"{np.percentile(gaps, 99):.1f} | {len(itls) / max(len(all_itls), 1):.1%} | "
            f"{np.sum(itls > p99) / max(np.sum(all_itls > p99), 1):.1%} |"
        )
    lines.append(f"\nITLs handed out: {len(all_itls)}, P50 {np.percentile(all_itls, 50):.1f} ms, "
                 f"P99 {p99:.1f} ms" if len(all_itls) else "\nno step had decode rows")
    return "\n".join(lines)


def _itls(records: list[dict]) -> np.ndarray:
    """One inter-token latency (ms) per decode row of each step."""
    return np.array([r["gap_s"] * 1e3 for r in records for _ in range(r["decode_rows"])])


def largest_gaps(records: list[dict], top: int) -> str:
    lines = ["| gap ms | kind | bucket | decode rows | prefill tokens (chunks) | padded | waiting | dispatch ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: -r["gap_s"])[:top]:
        lines.append(f"| {r['gap_s'] * 1e3:.1f} | {r['kind']} | {bucket_name(r)} | {r['decode_rows']} | "
                     f"{r['prefill_tokens']} ({r['prefill_chunks']}) | {r['padded_tokens']} | {r['waiting']} | "
                     f"{r['dispatch_s'] * 1e3:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=10, help="how many of the largest gaps to list")
    parser.add_argument("--idle-s", type=float, default=0.05,
                        help="a step launched this long after the previous one was ready counts from its launch")
    args = parser.parse_args(argv)
    records = with_gaps(read_trace(args.trace), args.idle_s)
    print(summary_table(records))
    print()
    print(largest_gaps(records, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
