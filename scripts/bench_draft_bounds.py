"""What a verified draft costs and pays, at its bounds: drafts that are always right and drafts that are always
wrong, against no speculation, in one process (offline `LLM` engines on the same model and grid).

A reference run without speculation gives each request's greedy tokens; then the speculative engine runs with a
proposer that drafts the next `--num-speculative-tokens` of those tokens (every draft accepted: the most
speculation can pay, what a draft model drafting for itself gives) and with one that drafts them shifted by one
token id (every draft rejected: what a useless draft costs). Greedy, exactly `--output-len` tokens per request
(`ignore_eos`), prompts of `--prompt-len` token ids, at each concurrency (`--concurrencies`: that many requests
at once, `--rounds` times). Reports output tokens per second and steps for each, the right drafts' and the
wrong drafts' throughput over no speculation, the share of the right drafts accepted, and how many outputs equal
those without speculation: all of them in float32; in bfloat16 a verifying step's rounding differs from a decode
step's, so at a near tie an output may take the other token, and from there the replayed drafts are wrong.

    python scripts/bench_draft_bounds.py                          # the embedded SmolLM2, the platform's grid
    python scripts/bench_draft_bounds.py --model DIR --dtype bfloat16 --buckets FILE   # e.g. on a GPU
    python scripts/bench_draft_bounds.py --random-model DIR       # SmolLM2's shape, random weights (no download)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's jaxserve, not an installed one
from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.speculative.proposer import Proposer
from jaxserve.testing.tiny_models import byte_level_tokenizer  # noqa: E402


class ReplayProposer(Proposer):
    """Drafts the reference continuation of the prompt each sequence starts with, shifted by ``shift`` token ids."""

    def __init__(self, k: int, continuations: dict[tuple[int, ...], list[int]], shift: int, vocab_size: int):
        self.k, self.continuations, self.shift, self.vocab_size = k, continuations, shift, vocab_size

    def propose(self, token_ids, max_drafts=None):
        for prompt, continuation in self.continuations.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                drafts = continuation[done : done + min(self.k, max_drafts)]
                return [(t + self.shift) % self.vocab_size for t in drafts]
        return []


def prompts_of(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab_size, length).tolist() for _ in range(num)]


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], float, int]:
    steps = llm.llm_engine.stats.num_steps
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return [o.outputs[0].token_ids for o in outputs], seconds, llm.llm_engine.stats.num_steps - steps


def run_concurrency(plain: LLM, spec: LLM, args, concurrency: int, vocab_size: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    row = {"concurrency": concurrency}
    for round_ in range(args.rounds):
        prompts = prompts_of(concurrency, args.prompt_len, vocab_size, seed=1000 * concurrency + round_)
        reference, seconds, steps = timed_generate(plain, prompts, params)
        _add(row, "off", seconds, steps, concurrency * args.output_len)
        continuations = {tuple(p): r for p, r in zip(prompts, reference, strict=True)}
        for name, shift in (("right", 0), ("wrong", 1)):
            spec.llm_engine.proposer = ReplayProposer(args.num_speculative_tokens, continuations, shift, vocab_size)
            stats = spec.llm_engine.stats
            drafted, accepted = stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens
            tokens, seconds, steps = timed_generate(spec, prompts, params)
            _add(row, name, seconds, steps, concurrency * args.output_len)
            row[f"{name}_drafted"] = row.get(f"{name}_drafted", 0) + stats.num_spec_draft_tokens - drafted
            row[f"{name}_accepted"] = row.get(f"{name}_accepted", 0) + stats.num_spec_accepted_tokens - accepted
            row[f"{name}_same_outputs"] = row.get(f"{name}_same_outputs", 0) + sum(
                a == b for a, b in zip(tokens, reference, strict=True))
    for name in ("off", "right", "wrong"):
        row[f"{name}_tok_s"] = row[f"{name}_tokens"] / row[f"{name}_s"]
    for name in ("right", "wrong"):
        row[f"{name}_acceptance"] = row[f"{name}_accepted"] / max(row[f"{name}_drafted"], 1)
    row["right_vs_off"] = row["right_tok_s"] / row["off_tok_s"]
    row["wrong_vs_off"] = row["wrong_tok_s"] / row["off_tok_s"]
    return row


def _add(row: dict, name: str, seconds: float, steps: int, tokens: int) -> None:
    for key, value in (("s", seconds), ("steps", steps), ("tokens", tokens)):
        row[f"{name}_{key}"] = row.get(f"{name}_{key}", 0) + value


def random_smollm2(path: str, **overrides) -> str:
    """A random Llama of SmolLM2-135M's shape (``overrides``: other LlamaConfig values) saved as a Hugging Face
    directory, with the tests' byte-level tokenizer (`jaxserve.testing.tiny_models`)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(**{
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192, "rope_theta": 100000.0,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, **overrides,
    })
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--random-model", default=None, help="write SmolLM2's shape with random weights here; serve it")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--buckets", default=None)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="each engine's (two share an accelerator)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--concurrencies", default="1,4,16")
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-async-plain", action="store_true",
                        help="the engine without speculation reads every step before planning the next, as the "
                        "speculative one does (async scheduling is on by default on TPU and GPU)")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    model = random_smollm2(args.random_model) if args.random_model else args.model
    common = {"dtype": args.dtype, "buckets": args.buckets, "max_model_len": args.max_model_len,
              "num_kv_blocks": args.num_kv_blocks, "enable_prefix_caching": False}
    plain = LLM(model, **common, **({"async_scheduling": False} if args.no_async_plain else {}))
    spec = LLM(model, **common, speculative_config={
        "method": "ngram", "num_speculative_tokens": args.num_speculative_tokens, "disable_by_batch_size": 64})
    vocab_size = plain.llm_engine.model_config.vocab_size
    for llm in (plain, spec):  # first calls (host-side caches, the device's first launches) are not timed
        timed_generate(llm, prompts_of(2, args.prompt_len, vocab_size, seed=1), SamplingParams(max_tokens=8))
    rows = [run_concurrency(plain, spec, args, int(c), vocab_size) for c in args.concurrencies.split(",")]
    print("| concurrency | off tok/s | right drafts tok/s (vs off) | wrong drafts tok/s (vs off) | steps off / right / "
          "wrong | right drafts accepted | outputs equal to off (right, wrong) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        n = r["concurrency"] * args.rounds
        print(f"| {r['concurrency']} | {r['off_tok_s']:.1f} | {r['right_tok_s']:.1f} ({r['right_vs_off']:.2f}x) | "
              f"{r['wrong_tok_s']:.1f} ({r['wrong_vs_off']:.2f}x) | {r['off_steps']} / {r['right_steps']} / "
              f"{r['wrong_steps']} | {r['right_acceptance']:.0%} | {r['right_same_outputs']}/{n}, "
              f"{r['wrong_same_outputs']}/{n} |")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
