"""n-gram speculation on the embedded SmolLM2-135M-Instruct (float32, a small grid): on requests that copy their
prompt, the greedy tokens of the same engine without speculation, with most drafts accepted."""

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
    """(without, with speculation) on the same small grid, each with its own compile cache."""
    tmp = tmp_path_factory.mktemp("speculation")
    buckets = tmp / "buckets.toml"
    buckets.write_text(BUCKETS)
    common = {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 4, "buckets": str(buckets)}
    return (LLM(**common, compile_cache_dir=str(tmp / "plain")),
            LLM(**common, compile_cache_dir=str(tmp / "spec"), speculative_config=NGRAM))


def test_speculation_gives_the_greedy_tokens_of_no_speculation_on_copying_requests(llms):
    """One request of each task of the repetitive workload (its recipe, scripts/make_repetitive_workload.py)."""
    plain, spec = llms
    requests = load_script("make_repetitive_workload").requests()
    tokenizer = plain.get_tokenizer()
    prompts = [{"prompt_token_ids": chat_prompt_ids(tokenizer, requests[i]["messages"])} for i in (0, 16, 32)]
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    expected = [plain.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    got = [spec.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert got == expected
    stats = spec.llm_engine.stats
    assert stats.num_spec_drafts >= 30 and stats.num_spec_accepted_tokens >= 0.6 * stats.num_spec_draft_tokens
    assert stats.num_steps < 0.6 * plain.llm_engine.stats.num_steps
    assert stats.num_compiles_after_warm_up == 0
