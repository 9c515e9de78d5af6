"""Speculation on the embedded SmolLM2-135M-Instruct (float32, a small grid): on requests that copy their prompt,
n-gram drafts, suffix decoding and the model drafting for itself give the greedy tokens of the same engine without
speculation, with most n-gram drafts, every suffix draft of a repeated request and nearly every self-draft
accepted."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.engine_builder import make_proposer
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
batch_sizes = [4]
token_counts = [32]
"""
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    """(n-gram, the model drafting for itself) on the same small grid, the second reading the first's target
    executables from their compile cache. Pools of 256 blocks, 4 sequences of max_model_len (the CPU default's 2048
    blocks are 1.5 GB per pool of this model, and the self-drafting engine holds two)."""
    tmp = tmp_path_factory.mktemp("speculation")
    buckets = tmp / "buckets.toml"
    buckets.write_text(BUCKETS)
    common = {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 4, "num_kv_blocks": 256,
              "buckets": str(buckets), "compile_cache_dir": str(tmp / "cache")}
    ngram = LLM(**common, speculative_config=NGRAM)
    self_draft = {"model": str(ngram.llm_engine.model_path), "num_speculative_tokens": 4}
    return ngram, LLM(**common, speculative_config=self_draft)


@contextlib.contextmanager
def proposer(engine, replacement):
    """``engine`` with another proposer (None: no drafts, the engine without speculation) for a while."""
    kept, engine.proposer = engine.proposer, replacement
    try:
        yield engine
    finally:
        engine.proposer = kept


@pytest.fixture(scope="module")
def copying(llms):
    """One request of each task of the repetitive workload (its recipe, scripts/make_repetitive_workload.py), the
    greedy tokens of the n-gram engine without drafts (no speculation) and its steps for them."""
    ngram = llms[0]
    requests = load_script("make_repetitive_workload").requests()
    tokenizer = ngram.get_tokenizer()
    prompts = [{"prompt_token_ids": chat_prompt_ids(tokenizer, requests[i]["messages"])} for i in (0, 16, 32)]
    with proposer(ngram.llm_engine, None) as engine:
        steps = engine.stats.num_steps
        expected = [_greedy(ngram, p) for p in prompts]
        return prompts, expected, engine.stats.num_steps - steps


def _greedy(llm, prompt):
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def _counts(stats) -> np.ndarray:
    """(drafts, draft tokens, accepted tokens, steps) so far."""
    return np.array([stats.num_spec_drafts, stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens,
                     stats.num_steps])


def test_speculation_gives_the_greedy_tokens_of_no_speculation_on_copying_requests(llms, copying):
    spec, _ = llms
    prompts, expected, plain_steps = copying
    before = _counts(spec.llm_engine.stats)
    got = [_greedy(spec, p) for p in prompts]
    assert got == expected
    drafts, draft_tokens, accepted, steps = _counts(spec.llm_engine.stats) - before
    assert drafts >= 30 and accepted >= 0.6 * draft_tokens
    assert steps < 0.6 * plain_steps
    assert spec.llm_engine.stats.num_compiles_after_warm_up == 0


def test_suffix_decoding_gives_the_same_tokens_and_drafts_a_repeated_request_from_its_first_response(llms, copying):
    """Suffix decoding on the n-gram engine's grid (the same number of drafts): the three requests, then the first
    again, whose drafts come from its first response (the global trie) and are all accepted."""
    spec, _ = llms
    engine = spec.llm_engine
    config = dataclasses.replace(engine.config, speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    with proposer(engine, make_proposer(config, engine.grid, None, engine.mesh)):
        prompts, expected, _ = copying
        assert [_greedy(spec, p) for p in prompts] == expected
        before = _counts(engine.stats)
        assert _greedy(spec, prompts[0]) == expected[0]
        _, draft_tokens, accepted, _ = _counts(engine.stats) - before
        assert accepted == draft_tokens >= 70  # 95 tokens after the prefill's: at most 19 steps of 4 drafts
        assert engine.proposer.num_cached_requests == 4 and engine.stats.num_compiles_after_warm_up == 0


def test_the_model_drafting_for_itself_gives_the_same_tokens_and_nearly_every_draft_is_accepted(llms, copying):
    """The draft's steps and the verifying step round differently (other shapes), so a near tie may reject a draft:
    at most 2% of them."""
    _, drafting = llms
    prompts, expected, _ = copying
    assert [_greedy(drafting, p) for p in prompts] == expected
    stats = drafting.llm_engine.stats
    assert stats.num_spec_draft_tokens >= 200 and stats.num_spec_accepted_tokens >= 0.98 * stats.num_spec_draft_tokens
    assert stats.num_compiles_after_warm_up == 0
