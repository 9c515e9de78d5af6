"""Teacher-forced next-token agreement of each quantization scheme with the unquantized model.

The unquantized engine answers each chat of `../shared/workloads/chat_questions.jsonl` greedily (`--answer-tokens`
tokens, stopping at EOS); then every engine, the unquantized one included, reads each prompt + answer whole
(`prompt_logprobs=1`: its most likely token after every prefix). A scheme's agreement is the share of positions
where its most likely next token is the unquantized model's; reported over the whole sequences and over the
answers alone, with each engine's weight bytes. `--kv-cache-dtypes fp8` adds runs with that KV cache, unquantized
weights and with each scheme's.

    python scripts/quantization_accuracy.py                          # the embedded SmolLM2, the platform's dtype
    python scripts/quantization_accuracy.py --model DIR --dtype bfloat16 --schemes int8 fp8 --out acc.json
    python scripts/quantization_accuracy.py --schemes --other-dtypes float32   # what rounding alone changes
    python scripts/quantization_accuracy.py --schemes int8 --kv-cache-dtypes fp8   # + float8 KV, alone and with int8
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.config.quantization_config import KV_CACHE_DTYPE_CHOICES, QUANTIZATION_CHOICES
from jaxserve.entrypoints.cli import chat_prompt_ids

CHATS = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "chat_questions.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto", help="the unquantized model's dtype and the schemes' activations")
    parser.add_argument("--schemes", nargs="*", default=list(QUANTIZATION_CHOICES), choices=QUANTIZATION_CHOICES)
    parser.add_argument("--other-dtypes", nargs="*", default=[],
                        help="also the unquantized model in these dtypes (e.g. float32): the agreement that rounding "
                        "alone gives")
    parser.add_argument("--kv-cache-dtypes", nargs="*", default=[], choices=KV_CACHE_DTYPE_CHOICES[1:],
                        help="also these KV caches (fp8), with unquantized weights and with each scheme")
    parser.add_argument("--chats", type=Path, default=CHATS)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None, help="also write the results here (JSON)")
    return parser.parse_args(argv)


def make_llm(args: argparse.Namespace, quantization: str | None, dtype: str | None = None,
             kv_cache_dtype: str = "auto") -> LLM:
    return LLM(args.model, dtype=dtype or args.dtype, max_model_len=args.max_model_len, quantization=quantization,
               kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False, disable_log_stats=True)


def chat_prompts(llm: LLM, path: Path) -> list[list[int]]:
    """Each chat through the tokenizer's chat template; a model without one (a base model's GGUF) reads the
    messages' contents, one per line, as a plain prompt."""
    tokenizer = llm.get_tokenizer()
    chats = [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]
    if tokenizer.chat_template is None:
        return [tokenizer.encode("\n".join(m["content"] for m in chat) + "\n") for chat in chats]
    return [chat_prompt_ids(tokenizer, chat) for chat in chats]


def greedy_answers(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def most_likely_next(llm: LLM, sequences: list[list[int]]) -> list[np.ndarray]:
    """Per sequence, the engine's most likely token after each of its prefixes (positions 1 .. n-1)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [np.array([_top_token(entry) for entry in o.prompt_logprobs[1:]]) for o in outputs]


def _top_token(entry: dict) -> int:
    return next(token for token, logprob in entry.items() if logprob.rank == 1)


def weight_bytes(llm: LLM) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(llm.llm_engine.runner.params))


def agreement(reference: list[np.ndarray], ours: list[np.ndarray], answer_starts: list[int]) -> dict:
    whole = np.concatenate([r == o for r, o in zip(reference, ours, strict=True)])
    answers = np.concatenate([(r == o)[start - 1:] for r, o, start in zip(reference, ours, answer_starts,
                                                                           strict=True)])
    return {"agreement": float(whole.mean()), "positions": int(whole.size),
            "answer_agreement": float(answers.mean()), "answer_positions": int(answers.size)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    reference_llm = make_llm(args, None)
    prompts = chat_prompts(reference_llm, args.chats)
    sequences = [p + a for p, a in zip(prompts, greedy_answers(reference_llm, prompts, args.answer_tokens),
                                       strict=True)]
    reference = most_likely_next(reference_llm, sequences)
    results = {"model": args.model or "embedded SmolLM2-135M-Instruct", "dtype": reference_llm.llm_engine.config.dtype,
               "chats": len(prompts), "unquantized_weight_bytes": weight_bytes(reference_llm), "schemes": {}}
    print(f"unquantized ({results['dtype']}): {results['unquantized_weight_bytes'] / 1e6:.1f} MB of weights, "
          f"{len(sequences)} sequences, {time.perf_counter() - start:.0f}s", flush=True)
    del reference_llm
    runs = [(scheme, scheme, None, "auto") for scheme in args.schemes]
    runs += [(f"unquantized {dtype}", None, dtype, "auto") for dtype in args.other_dtypes]
    runs += [(f"{scheme or 'unquantized'} + {kv} KV cache", scheme, None, kv)
             for kv in args.kv_cache_dtypes for scheme in [None, *args.schemes]]
    for scheme, quantization, dtype, kv_cache_dtype in runs:
        gc.collect()
        llm = make_llm(args, quantization, dtype, kv_cache_dtype)
        result = agreement(reference, most_likely_next(llm, sequences), [len(p) for p in prompts])
        result["weight_bytes"] = weight_bytes(llm)
        results["schemes"][scheme] = result
        print(f"{scheme}: {100 * result['agreement']:.2f}% of {result['positions']} positions "
              f"({100 * result['answer_agreement']:.2f}% of the {result['answer_positions']} answer positions), "
              f"{result['weight_bytes'] / 1e6:.1f} MB of weights", flush=True)
        del llm
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
