"""A mixture-of-experts decode step against a dense model of the same active parameters, in one run.

Builds two random models with transformers (same attention, vocabulary and depth): a Qwen3-MoE with
`--experts` experts of `--moe-intermediate` hidden units, top-`--top-k`, and a dense Qwen3 whose MLP has
top-k × moe-intermediate hidden units, so each token multiplies by the same number of weights. Runs
`--batch` greedy requests through each engine and reports the median decode step (each step waited on) and
the ratio MoE / dense. The MoE model holds experts / top-k times the MLP weights of the dense one.

    python scripts/bench_moe_step.py                       # 16 experts, top-2, batch 1 and 16
    python scripts/bench_moe_step.py --experts 64 --top-k 8 --batch 1,32
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

BUCKETS = """block_size = 16
[decode]
batch_sizes = {batches}
[prefill]
batch_sizes = [1]
lengths = [32]
[context]
lengths = [256]
"""


def make_model(path: Path, moe: bool, args) -> Path:
    import torch
    import transformers

    common = dict(vocab_size=32000, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=args.hidden // 16, max_position_embeddings=4096,
                  tie_word_embeddings=False)
    if moe:
        config = transformers.Qwen3MoeConfig(**common, intermediate_size=args.moe_intermediate,
                                             moe_intermediate_size=args.moe_intermediate, num_experts=args.experts,
                                             num_experts_per_tok=args.top_k, norm_topk_prob=True)
    else:
        config = transformers.Qwen3Config(**common, intermediate_size=args.top_k * args.moe_intermediate)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def decode_step_ms(model_dir: Path, buckets: Path, batch: int, args) -> float:
    """Median milliseconds of the engine's decode steps with `batch` running requests."""
    import jax

    from jaxserve import LLM, SamplingParams
    from jaxserve.core.buckets import DecodeBucket

    llm = LLM(str(model_dir), dtype=args.dtype, buckets=str(buckets), max_model_len=256)
    engine = llm.llm_engine
    engine.async_scheduling = False
    times: list[float] = []
    execute = engine.runner.execute

    def timed_execute(bucket, inputs, prev_tokens=None):
        start = time.perf_counter()
        output = execute(bucket, inputs, prev_tokens)
        jax.block_until_ready(output.tokens)
        if isinstance(bucket, DecodeBucket):
            times.append(time.perf_counter() - start)
        return output

    engine.runner.execute = timed_execute
    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1 + i, 5, 9, 11]} for i in range(batch)], params, use_tqdm=False)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--moe-intermediate", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per run")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        buckets = root / "buckets.toml"
        buckets.write_text(BUCKETS.format(batches=batches))
        moe, dense = make_model(root / "moe", True, args), make_model(root / "dense", False, args)
        print(f"Qwen3-MoE {args.experts} experts top-{args.top_k} x {args.moe_intermediate} against dense Qwen3 "
              f"MLP {args.top_k * args.moe_intermediate}; hidden {args.hidden}, {args.layers} layers, {args.dtype}")
        print("| batch | MoE decode step (ms) | dense decode step (ms) | MoE / dense |")
        print("|---|---|---|---|")
        for batch in batches:
            moe_ms, dense_ms = decode_step_ms(moe, buckets, batch, args), decode_step_ms(dense, buckets, batch, args)
            print(f"| {batch} | {moe_ms:.1f} | {dense_ms:.1f} | {moe_ms / dense_ms:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
