"""Plan a bucket file from a request-length trace and a budget of executables.

Reads a jsonl trace (`{"prompt_len", "output_len"}` a line, like shared/workloads/mixed_lengths.jsonl),
writes the bucket file with the least expected padding within the budget, and prints its expected
padding against the best power-of-two buckets under the same budget (see jaxserve/compilation/bucket_planner.py):

    python scripts/plan_buckets.py ../shared/workloads/mixed_lengths.jsonl --budget 24 --out mine.toml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from jaxserve.compilation.bucket_planner import describe_trace, plan_buckets, read_trace  # noqa: E402
from jaxserve.core.buckets import load_bucket_spec  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="jsonl file with prompt_len and output_len per request")
    parser.add_argument("--budget", type=int, required=True, help="most executables (decode + prefill buckets)")
    parser.add_argument("--out", required=True, help="bucket file to write (.toml)")
    parser.add_argument("--base", default="cpu", help="spec giving batch sizes and block_size (name or path)")
    parser.add_argument("--chunk-multiple", type=int, default=1, help="prefill lengths are multiples of this")
    parser.add_argument("--max-chunk-len", type=int, default=None,
                        help="longest prefill chunk (default: the longest prompt, so no prompt is chunked)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the largest context bucket holds this (default: the longest request of the trace)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="engine limit (default: largest decode batch)")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="engine KV pool, for pruning (default: a pool that prunes nothing)")
    parser.add_argument("--context-weight", type=float, default=1.0,
                        help="weight of context padding against prefill padding in the objective")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    trace = read_trace(args.trace)
    base = load_bucket_spec(args.base)
    out = Path(args.out)
    plan = plan_buckets(
        trace, args.budget, base, chunk_multiple=args.chunk_multiple, max_chunk_len=args.max_chunk_len,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks,
        context_weight=args.context_weight, trace_source=Path(args.trace).name,
        output_source=str(out),
    )
    out.write_text(plan.to_toml())
    print(f"trace {args.trace}: {describe_trace(trace)}")
    print(f"budget {args.budget} executables; batch sizes and block_size {base.block_size} from {base.source}")
    print("expected padding, one sequence per step (prefill: chunk tokens; context: attended tokens):")
    print(plan.format_table())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
