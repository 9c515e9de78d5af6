"""bfloat16 teacher-forced agreement of every model family, on tiny random models (no real weights here but
Gemma 3's: `check_model_parity.py --bf16-agreement`): transformers' float32 greedy continuation of a prompt,
then the engine in bfloat16 fed prompt + continuation (`prompt_logprobs`), and the share of continuation
positions where the engine's rank-1 token is the one transformers chose.

    python scripts/check_family_bf16.py                   # every tiny family of jaxserve.testing.tiny_models
    python scripts/check_family_bf16.py --families qwen3-gqa,gemma3-local-rope --new-tokens 64

Random tiny models have flatter logits than trained ones (near ties are common), so these shares are a floor
for what bfloat16 costs, not an estimate of it on a real model.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # this checkout's jaxserve, not an installed one

from jaxserve.testing.hf_reference import hf_greedy  # noqa: E402
from jaxserve.testing.small_buckets import small_bucket_file  # noqa: E402
from jaxserve.testing.tiny_models import FAMILY_TOKENS, TINY_FAMILIES, make_tiny_model  # noqa: E402


def teacher_forced_agreement(model_dir: Path, buckets: str, prompt: list[int], continuation: list[int]) -> float:
    from jaxserve import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="bfloat16", buckets=buckets, max_model_len=128, enable_prefix_caching=False)
    sequence = prompt + continuation
    (out,) = llm.generate([{"prompt_token_ids": sequence}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                          use_tqdm=False)
    agree = 0
    for position in range(len(prompt), len(sequence)):
        ranked = out.prompt_logprobs[position]
        agree += next(token for token, lp in ranked.items() if lp.rank == 1) == sequence[position]
    return agree / len(continuation)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(sorted(TINY_FAMILIES)))
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    total = agree = 0
    with tempfile.TemporaryDirectory() as tmp:
        buckets = small_bucket_file(Path(tmp), chunk=64)
        print("| family (tiny config) | positions | bfloat16 rank-1 = float32 greedy |\n|---|---|---|")
        for name in args.families.split(","):
            family, overrides = TINY_FAMILIES[name]
            model_dir = make_tiny_model(Path(tmp) / name, family, **overrides)
            continuation = hf_greedy(model_dir, FAMILY_TOKENS, args.new_tokens)
            share = teacher_forced_agreement(model_dir, buckets, FAMILY_TOKENS, continuation)
            print(f"| {name} | {len(continuation)} | {100 * share:.1f}% |", flush=True)
            total, agree = total + len(continuation), agree + share * len(continuation)
    print(f"all families: {100 * agree / total:.1f}% of {total} positions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
