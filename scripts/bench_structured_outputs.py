"""Decode step time with 0, 50% and 100% of a decode batch constrained by a JSON schema (structured outputs).

One engine (the embedded model unless `--model`), one run per share, in this order: 0%, 50%, 100%, then 0%
again (drift check). Each run is `--batch` requests of the same short chat prompt, `--max-tokens` new tokens
each; constrained requests follow a JSON schema whose one string field needs at least 400 characters, so no
constrained request ends before `--max-tokens` (its grammar forbids EOS until then) and unconstrained ones run
with `ignore_eos`: every run does the same number of decode steps. Reported: mean and median wall time of the
decode-only steps (the engine's `step()`: with async scheduling it dispatches step N+1, reads step N's tokens,
fills the masks of N+1's constrained rows and dispatches N+1's sampling, without waiting for N+1), the host
time filling bitmasks, the steps sampled after their masks were filled, and each run's mean over the first
0% run's.
`--compare-sync` runs the same on a second engine with `async_scheduling=False` (every step read before the
next is planned, masks filled before the step: what a constrained request cost every row before resampling).

    python scripts/bench_structured_outputs.py                      # batch 32, 64 tokens, dtype auto
    python scripts/bench_structured_outputs.py --compare-sync
    python scripts/bench_structured_outputs.py --batch 32 --max-tokens 96 --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import time

LONG_TEXT = {"type": "object", "properties": {"text": {"type": "string", "minLength": 400}}, "required": ["text"]}


def run(llm, prompt: dict, batch: int, num_constrained: int, max_tokens: int) -> dict:
    from jaxserve import SamplingParams, StructuredOutputsParams
    from jaxserve.engine.structured_outputs import GrammarMatcher

    engine = llm.llm_engine
    schema = StructuredOutputsParams(json=LONG_TEXT)
    mask_seconds = [0.0]
    original = GrammarMatcher.allowed_tokens

    def timed(self):
        start = time.perf_counter()
        try:
            return original(self)
        finally:
            mask_seconds[0] += time.perf_counter() - start

    GrammarMatcher.allowed_tokens = timed
    try:
        for i in range(batch):
            constrained = i < num_constrained
            params = SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=not constrained,
                                    structured_outputs=schema if constrained else None)
            engine.add_request(f"r{num_constrained}-{i}", prompt, params)
        decode_steps = []
        lengths = {}
        late_before = engine.stats.num_late_sampled_steps
        while engine.has_unfinished_requests():
            before = engine.stats.num_decode_steps
            start = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - start
            if engine.stats.num_decode_steps > before:
                decode_steps.append(elapsed)
            lengths.update({o.request_id: len(o.outputs[0].token_ids) for o in outputs if o.finished})
    finally:
        GrammarMatcher.allowed_tokens = original
    assert set(lengths.values()) == {max_tokens}, f"every request runs {max_tokens} tokens: {lengths}"
    return {"constrained": num_constrained, "decode_steps": len(decode_steps),
            "mean_ms": 1e3 * statistics.mean(decode_steps), "median_ms": 1e3 * statistics.median(decode_steps),
            "mask_ms_per_step": 1e3 * mask_seconds[0] / max(len(decode_steps), 1),
            "late_sampled_steps": engine.stats.num_late_sampled_steps - late_before}


def bench_engine(llm, prompt: dict, batch: int, max_tokens: int) -> list[dict]:
    run(llm, prompt, batch, batch // 2, 8)  # warm: llguidance's lexer states for the schema, caches
    return [run(llm, prompt, batch, n, max_tokens) for n in (0, batch // 2, batch, 0)]


def print_table(title: str, results: list[dict], batch: int, base_ms: float) -> None:
    print(f"\n{title}\n")
    print("| constrained rows | decode steps | mean step ms | median step ms | bitmask fill ms / step "
          "| steps sampled after the masks | mean / 0% async |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['constrained']} of {batch} | {r['decode_steps']} | {r['mean_ms']:.2f} | {r['median_ms']:.2f} "
              f"| {r['mask_ms_per_step']:.2f} | {r['late_sampled_steps']} | {r['mean_ms'] / base_ms:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--compare-sync", action="store_true",
                        help="also run an engine with async_scheduling=False (every step waits for the one before)")
    args = parser.parse_args()

    from jaxserve import LLM
    from jaxserve.entrypoints.cli import chat_prompt_ids

    engine_args = dict(dtype=args.dtype, max_model_len=1024, max_num_seqs=max(args.batch, 1))
    llm = LLM(args.model, async_scheduling=True, **engine_args)
    question = [{"role": "user", "content": "Write a long paragraph about the sea, as JSON."}]
    prompt = {"prompt_token_ids": chat_prompt_ids(llm.get_tokenizer(), question)}
    tables = [("async scheduling (the default on TPU and GPU)", bench_engine(llm, prompt, args.batch, args.max_tokens))]
    if args.compare_sync:
        del llm
        sync = LLM(args.model, async_scheduling=False, **engine_args)
        sync_results = bench_engine(sync, prompt, args.batch, args.max_tokens)
        tables.append(("async_scheduling=False (the default on CPU)", sync_results))
    print(f"decode batch {args.batch}, {args.max_tokens} tokens each, dtype {args.dtype}; JSON schema {LONG_TEXT}")
    base = tables[0][1][0]["mean_ms"]
    for title, results in tables:
        print_table(title, results, args.batch, base)


if __name__ == "__main__":
    main()
