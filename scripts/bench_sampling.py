"""Decode-step cost of the sampling features: the same batch decoded with different SamplingParams.

Every scenario runs `--batch` requests of `--prompt-len` seeded random tokens for `--max-tokens` tokens
(ignore_eos) on one engine (compiled once), and reports the mean and median wall time of a decode step.
The greedy scenario is the lax.cond fast path (argmax only); the others add their stage of the sampler.

    python scripts/bench_sampling.py                                   # embedded model, CPU buckets
    python scripts/bench_sampling.py --model path/to/hf_dir --scenarios greedy,random
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def scenarios(vocab_size: int) -> dict:
    from jaxserve import SamplingParams

    common = {"ignore_eos": True}
    return {
        "greedy": lambda n: SamplingParams(temperature=0.0, max_tokens=n, **common),
        "random": lambda n: SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1, max_tokens=n, **common),
        "t1-top_p0.95": lambda n: SamplingParams(temperature=1.0, top_p=0.95, max_tokens=n, **common),
        "t1": lambda n: SamplingParams(temperature=1.0, max_tokens=n, **common),
        "penalties": lambda n: SamplingParams(temperature=0.0, repetition_penalty=1.1, presence_penalty=0.5,
                                              frequency_penalty=0.5, max_tokens=n, **common),
        "logit_bias+min_tokens": lambda n: SamplingParams(
            temperature=0.0, logit_bias={i: 1.0 for i in range(0, vocab_size, 97)}, min_tokens=n // 2,
            max_tokens=n, **common),
        "logprobs=5": lambda n: SamplingParams(temperature=0.0, logprobs=5, max_tokens=n, **common),
        "n=4": lambda n: SamplingParams(n=4, temperature=0.8, seed=2, max_tokens=n, **common),
    }


def run_scenario(llm, make_params, args, rng) -> list[float]:
    engine = llm.llm_engine
    params = make_params(args.max_tokens)
    num_requests = args.batch // params.n
    for i in range(num_requests):
        prompt = rng.integers(100, engine.model_config.vocab_size, size=args.prompt_len).tolist()
        engine.add_request(f"bench-{i}", {"prompt_token_ids": prompt}, params)
    times = []
    while engine.has_unfinished_requests():
        decode_steps = engine.stats.num_decode_steps
        start = time.perf_counter()
        engine.step()
        if engine.stats.num_decode_steps > decode_steps:
            times.append(time.perf_counter() - start)
    return times[2:]  # the first decode steps include forks and copy-on-write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF dir / GGUF; default: the embedded SmolLM2-135M")
    parser.add_argument("--buckets", default="cpu")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--scenarios", default=None, help="comma-separated subset")
    args = parser.parse_args()

    from jaxserve import LLM

    llm = LLM(args.model, max_model_len=args.max_model_len, buckets=args.buckets)
    table = scenarios(llm.llm_engine.model_config.vocab_size)
    names = args.scenarios.split(",") if args.scenarios else list(table)
    rng = np.random.default_rng(0)
    run_scenario(llm, table["greedy"], args, rng)  # warm the host paths
    print(f"| scenario (batch {args.batch}) | decode steps | mean ms/step | median ms/step |")
    print("|---|---|---|---|")
    for name in names:
        times = run_scenario(llm, table[name], args, rng)
        print(f"| {name} | {len(times)} | {1e3 * statistics.mean(times):.2f} | {1e3 * statistics.median(times):.2f} |")


if __name__ == "__main__":
    main()
