"""Speculation on the embedded SmolLM2-135M-Instruct (float32, a small grid): on requests that copy their prompt,
n-gram drafts and the model drafting for itself give the greedy tokens of the same engine without speculation,
with most n-gram drafts and nearly every self-draft accepted."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.entrypoints.cli import chat_prompt_ids
from tests.paths import load_script

BUCKETS = """block_size = 16
[decode]
batch_sizes = [1, 4]
[prefill]
batch_sizes = [1]
lengths = [64, 256]
[context]
lengths = [1024]
[mixed]
batch_sizes = [16]
token_counts = [32]
"""
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    """(without speculation, n-gram, the model drafting for itself) on the same small grid, each with its own compile
    cache."""
    tmp = tmp_path_factory.mktemp("speculation")
    buckets = tmp / "buckets.toml"
    buckets.write_text(BUCKETS)
    common = {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 4, "buckets": str(buckets)}
    plain = LLM(**common, compile_cache_dir=str(tmp / "plain"))
    self_draft = {"model": str(plain.llm_engine.model_path), "num_speculative_tokens": 4}
    return (plain, LLM(**common, compile_cache_dir=str(tmp / "spec"), speculative_config=NGRAM),
            LLM(**common, compile_cache_dir=str(tmp / "spec"), speculative_config=self_draft))


@pytest.fixture(scope="module")
def copying(llms):
    """One request of each task of the repetitive workload (its recipe, scripts/make_repetitive_workload.py), and the
    greedy tokens of the engine without speculation."""
    requests = load_script("make_repetitive_workload").requests()
    tokenizer = llms[0].get_tokenizer()
    prompts = [{"prompt_token_ids": chat_prompt_ids(tokenizer, requests[i]["messages"])} for i in (0, 16, 32)]
    return prompts, [_greedy(llms[0], p) for p in prompts]


def _greedy(llm, prompt):
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_speculation_gives_the_greedy_tokens_of_no_speculation_on_copying_requests(llms, copying):
    plain, spec, _ = llms
    prompts, expected = copying
    got = [_greedy(spec, p) for p in prompts]
    assert got == expected
    stats = spec.llm_engine.stats
    assert stats.num_spec_drafts >= 30 and stats.num_spec_accepted_tokens >= 0.6 * stats.num_spec_draft_tokens
    assert stats.num_steps < 0.6 * plain.llm_engine.stats.num_steps
    assert stats.num_compiles_after_warm_up == 0


def test_the_model_drafting_for_itself_gives_the_same_tokens_and_nearly_every_draft_is_accepted(llms, copying):
    """The draft's steps and the verifying step round differently (other shapes), so a near tie may reject a draft:
    at most 2% of them."""
    _, _, drafting = llms
    prompts, expected = copying
    assert [_greedy(drafting, p) for p in prompts] == expected
    stats = drafting.llm_engine.stats
    assert stats.num_spec_draft_tokens >= 200 and stats.num_spec_accepted_tokens >= 0.98 * stats.num_spec_draft_tokens
    assert stats.num_compiles_after_warm_up == 0
