"""The embedded SmolLM2-135M-Instruct (GGUF): greedy tokens equal transformers' on the shared chats."""

from __future__ import annotations

import asyncio
import json

import pytest

from jaxserve import LLM, AsyncLLMEngine, SamplingParams
from jaxserve.entrypoints.cli import chat_prompt_ids
from tests.embedded_reference import NEW_TOKENS, WORKLOADS, chats, hf_greedy, top2_gap

BATCHING_TOKENS = 8  # outputs of the batching test are capped so that 32 requests also run alone quickly


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=1024, max_num_seqs=32)


def test_greedy_tokens_match_transformers_on_every_chat(llm):
    tokenizer = llm.get_tokenizer()
    conversations = chats()
    assert len(conversations) == 32
    prompts = [{"prompt_token_ids": chat_prompt_ids(tokenizer, msgs)} for msgs in conversations]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)
    num_exact = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        ours = output.outputs[0].token_ids
        expected, logits = hf_greedy(tuple(prompt["prompt_token_ids"]), tokenizer.eos_token_id)
        if ours == expected:
            num_exact += 1
            continue
        # the only excuse for a different token is a near tie in the reference logits at that point
        first = next(i for i, (a, b) in enumerate(zip(ours, expected, strict=False)) if a != b)
        assert top2_gap(logits[first]) < 1e-3, (first, ours, expected)
    assert num_exact >= 30


def _text_prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Prompts of exactly the given lengths, cut from the chats' text (real text, not random ids)."""
    text = " ".join(m["content"] for msgs in chats() for m in msgs)
    ids = tokenizer(text).input_ids
    ids = ids * (max(lengths) // len(ids) + 2)
    return [ids[i * 7 : i * 7 + n] for i, n in enumerate(lengths)]


def test_continuous_batching_changes_no_token(llm):
    rows = [json.loads(line) for line in (WORKLOADS / "mixed_lengths.jsonl").read_text().splitlines()[:32]]
    prompts = _text_prompts(llm.get_tokenizer(), [r["prompt_len"] for r in rows])
    assert [len(p) for p in prompts] == [r["prompt_len"] for r in rows]
    params = [SamplingParams(temperature=0.0, max_tokens=min(r["output_len"], BATCHING_TOKENS), ignore_eos=True)
              for r in rows]
    alone = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids
             for p, sp in zip(prompts, params, strict=True)]
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == alone
    assert [len(t) for t in alone] == [sp.max_tokens for sp in params]
    engine = llm.llm_engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_generate_returns_vllm_shaped_outputs(llm):
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert len(outputs) == 1
    out = outputs[0]
    assert out.prompt == "The capital of France is"
    assert out.prompt_token_ids == llm.get_tokenizer()("The capital of France is").input_ids
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids)


def test_requests_arriving_while_others_decode_change_no_token(llm):
    """Mixed steps on the real model: requests that arrive while others decode share steps with them (offline
    and through AsyncLLMEngine), and every request's greedy tokens equal its tokens alone."""
    prompts = _text_prompts(llm.get_tokenizer(), [40, 300, 9, 150, 70])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    engine = llm.llm_engine
    mixed_before = engine.stats.num_mixed_steps
    arrivals, finished = {0: [0], 2: [1, 2], 5: [3, 4]}, {}
    for step in range(200):
        for i in arrivals.get(step, []):
            engine.add_request(f"trace-{i}", {"prompt_token_ids": prompts[i]}, params)
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests() and step > max(arrivals):
            break
    assert [finished[f"trace-{i}"] for i in range(len(prompts))] == alone
    assert engine.stats.num_mixed_steps - mixed_before >= 3

    async_engine = AsyncLLMEngine(engine)

    async def one(i: int) -> list[int]:
        outputs = [o async for o in async_engine.generate({"prompt_token_ids": prompts[i]}, params, f"async-{i}")]
        return outputs[-1].outputs[0].token_ids

    async def all_requests():
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    mixed_before = engine.stats.num_mixed_steps
    assert asyncio.run(all_requests()) == alone
    assert engine.stats.num_mixed_steps > mixed_before
