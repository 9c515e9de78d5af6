"""The accuracy bar of the bfloat16 policy (bf16 weights and KV pool, float32 accumulation and activations;
`dtype="auto"` on CPUs with a bf16 matrix unit) on the embedded SmolLM2-135M-Instruct, against transformers
in float32, on every chat of shared/workloads/chat_questions.jsonl.

- Teacher-forced: each chat's prompt followed by transformers' float32 greedy continuation (up to 32 tokens)
  goes through the engine as one prompt with `prompt_logprobs`; at each continuation position the engine's
  argmax must be transformers' token (its rank 1). Bar: at least TEACHER_FORCED_AGREEMENT of all positions.
- Greedy: the engine's 32 greedy tokens against transformers'. Where a chat diverges, float32's top-2 logit
  gap at the first differing position must be below MAX_DIVERGENCE_GAP (bf16 rounding may flip a near tie,
  nothing else), and at least MIN_EXACT_CHATS chats must match exactly.

The thresholds come from measurement (2026-11-23, jax 0.10.2, this repository's CPU path): see the
constants' comments.
"""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.compilation.compile_cache import num_backend_compiles
from jaxserve.entrypoints.cli import chat_prompt_ids
from jaxserve.testing.small_buckets import small_bucket_file
from tests.embedded_reference import NEW_TOKENS, chats, hf_greedy_references

# measured: 896 of 899 positions (99.7%); the 3 misses at f32 top-2 gaps of 0.022, 0.026 and 0.054
TEACHER_FORCED_AGREEMENT = 0.99
# measured: 29 of 32 chats exact; the 3 divergences at f32 gaps of 0.003, 0.026 and 0.029 (logits span ~20)
MAX_DIVERGENCE_GAP = 0.1
MIN_EXACT_CHATS = 28


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """Only the buckets these tests select (prompts of up to ~100 tokens in chunks of 128, 32 rows decoding): the
    accuracy bar is the dtype policy's, and on a CPU without a bf16 unit each bfloat16 executable compiles for
    ~15 s."""
    buckets = small_bucket_file(tmp_path_factory.mktemp("buckets"), (32,), chunk=128, context=1024)
    return LLM(dtype="bfloat16", max_model_len=1024, max_num_seqs=32, buckets=buckets)


@pytest.fixture(scope="module")
def references(llm, reference_dir):
    """(prompt ids, transformers' greedy tokens, their f32 top-2 margins) of every chat."""
    tokenizer = llm.get_tokenizer()
    prompts = [chat_prompt_ids(tokenizer, messages) for messages in chats()]
    greedy = hf_greedy_references(prompts, tokenizer.eos_token_id, reference_dir)
    return [(prompt, ref.tokens, ref.gaps) for prompt, ref in zip(prompts, greedy, strict=True)]


def test_teacher_forced_argmax_agrees_with_float32_transformers(llm, references):
    prompts = [{"prompt_token_ids": prompt + tokens} for prompt, tokens, _ in references]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    compiles_before = num_backend_compiles()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert num_backend_compiles() == compiles_before  # nothing compiles after warm-up in bfloat16 either
    agree = total = 0
    disagreements = []
    for (prompt, tokens, gaps), output in zip(references, outputs, strict=True):
        for i, token in enumerate(tokens):
            rank = output.prompt_logprobs[len(prompt) + i][token].rank
            total += 1
            agree += rank == 1
            if rank != 1:
                disagreements.append(gaps[i])
    print(f"teacher-forced agreement {agree}/{total}; f32 gaps where not: {sorted(disagreements)}")
    assert total == sum(len(tokens) for _, tokens, _ in references)
    assert agree / total >= TEACHER_FORCED_AGREEMENT


def test_greedy_divergences_only_at_near_ties(llm, references):
    prompts = [{"prompt_token_ids": prompt} for prompt, _, _ in references]
    compiles_before = num_backend_compiles()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)
    assert num_backend_compiles() == compiles_before
    exact, gaps = 0, []
    for (_, expected, ref_gaps), output in zip(references, outputs, strict=True):
        ours = output.outputs[0].token_ids
        if ours == expected:
            exact += 1
            continue
        first = next(i for i, (a, b) in enumerate(zip(ours, expected, strict=False)) if a != b)
        gaps.append((first, ref_gaps[first]))
    print(f"greedy: {exact}/{len(references)} chats exact; divergences (position, f32 top-2 gap): {gaps}")
    assert all(gap < MAX_DIVERGENCE_GAP for _, gap in gaps), gaps
    assert exact >= MIN_EXACT_CHATS
