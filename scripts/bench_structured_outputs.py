"""Decode step time with 0, 50% and 100% of a decode batch constrained by a JSON schema (structured outputs).

One engine (the embedded model unless `--model`), one run per share, in this order: 0%, 50%, 100%, then 0%
again (drift check). Each run is `--batch` requests of the same short chat prompt, `--max-tokens` new tokens
each; constrained requests follow a JSON schema whose one string field needs at least 400 characters, so no
constrained request ends before `--max-tokens` (its grammar forbids EOS until then) and unconstrained ones run
with `ignore_eos`: every run does the same number of decode steps. Reported: mean and median wall time of the
decode-only steps (the engine's `step()`, which with a constrained request in the batch also waits for the step
it launched: a constrained row needs its last token on the host before its next mask), the host time filling
bitmasks, and each run's mean over the first 0% run's.

    python scripts/bench_structured_outputs.py                      # batch 32, 64 tokens, dtype auto
    python scripts/bench_structured_outputs.py --batch 32 --max-tokens 96 --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import time

LONG_TEXT = {"type": "object", "properties": {"text": {"type": "string", "minLength": 400}}, "required": ["text"]}


def run(llm, prompt: dict, batch: int, num_constrained: int, max_tokens: int) -> dict:
    from jaxserve import SamplingParams, StructuredOutputsParams
    from jaxserve.structured_outputs import GrammarMatcher

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
            "mask_ms_per_step": 1e3 * mask_seconds[0] / max(len(decode_steps), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    from jaxserve import LLM
    from jaxserve.entrypoints.cli import chat_prompt_ids

    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=max(args.batch, 1))
    question = [{"role": "user", "content": "Write a long paragraph about the sea, as JSON."}]
    prompt = {"prompt_token_ids": chat_prompt_ids(llm.get_tokenizer(), question)}
    run(llm, prompt, args.batch, args.batch // 2, 8)  # warm: llguidance's lexer states for the schema, caches
    results = [run(llm, prompt, args.batch, n, args.max_tokens)
               for n in (0, args.batch // 2, args.batch, 0)]
    base = results[0]["mean_ms"]
    print(f"decode batch {args.batch}, {args.max_tokens} tokens each, dtype {args.dtype}; JSON schema {LONG_TEXT}\n")
    print("| constrained rows | decode steps | mean step ms | median step ms | bitmask fill ms / step | mean / 0% |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['constrained']} of {args.batch} | {r['decode_steps']} | {r['mean_ms']:.2f} | {r['median_ms']:.2f} "
              f"| {r['mask_ms_per_step']:.2f} | {r['mean_ms'] / base:.2f}x |")


if __name__ == "__main__":
    main()
