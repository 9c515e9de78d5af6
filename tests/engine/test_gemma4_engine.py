"""Gemma 4 in the engine (tiny random model: pages of two shapes, KV-sharing layers, per-layer inputs, experts): each
kind of page has its own block ids and free list, and greedy tokens equal transformers through n-gram drafts and
their rejections, preemptions of a tight pool and prefix-cache hits, and greedy samples forked with n = 2 (copy-on-write
in both kinds of page) continue as one. (Sampling and beams against the engine with a full group per kind are
tests/engine/test_kv_cache_groups.py's, on Gemma 3; a second Gemma 4 engine cost the suite 40 s.)"""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config.kv_cache_groups import NULL_BLOCK
from jaxserve.testing.hf_reference import hf_greedy
from jaxserve.testing.tiny_models import make_tiny_model
from tests.engine.test_kv_cache_groups import NGRAM, PROMPTS
from tests.models.test_family_engines import BUCKETS

MAX_TOKENS = 32
KV_BLOCKS = 40  # ids of both kinds: 24 sliding (15 for a step's chunks) and 16 full (a 64-token request holds 16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gemma4") / "model", "gemma4", seed=6)


@pytest.fixture(scope="module")
def llm(model_dir, tmp_path_factory):
    """The engine in KV cache groups, n-gram drafts and prefix caching on, 40 blocks of 4 tokens."""
    buckets = tmp_path_factory.mktemp("buckets") / "buckets.toml"
    buckets.write_text(BUCKETS.format(block_size=4))
    return LLM(str(model_dir), dtype="float32", buckets=str(buckets), max_model_len=64, max_num_seqs=4,
               speculative_config=NGRAM, enable_prefix_caching=True, num_kv_blocks=KV_BLOCKS)


@pytest.fixture(scope="module")
def expected(model_dir):
    return [hf_greedy(model_dir, p, MAX_TOKENS) for p in PROMPTS]


def test_each_kind_of_page_has_its_share_of_the_block_ids(llm):
    groups = llm.llm_engine.block_manager
    # the full layer 2 (kind 1), the sliding layers 0, 1 and 3 (kind 0); layers 4-6 read layers 3 and 2
    assert (groups.group_windows, groups.group_kinds, groups.kind_blocks) == ((None, 5, 5, 5), (1, 0, 0, 0), (24, 16))
    runner = llm.llm_engine.runner
    (k_sliding, _), (k_full, _) = runner.kv_pool
    assert (k_sliding.shape, k_full.shape) == ((1, 2, 24, 4, 24), (1, 1, 16, 4, 48))
    assert runner.group_block_offsets == (24, 0, 0, 0)


def test_greedy_tokens_equal_transformers_through_drafts_preemptions_and_cache_hits(llm, expected):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)  # no EOS: as transformers
    engine = llm.llm_engine
    manager = engine.block_manager
    for i, prompt in enumerate(PROMPTS * 2):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    preemptions, outputs = engine.stats.num_preemptions, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[int(output.request_id)] = output.outputs[0].token_ids
        for seq in engine.scheduler.running:  # a group's table holds ids of its kind only
            for table, kind in zip(seq.block_tables, manager.group_kinds, strict=True):
                assert all(manager.kind_of(block) == kind for block in table if block != NULL_BLOCK)
    assert [outputs[i] for i in range(len(outputs))] == expected * 2
    assert engine.stats.num_preemptions > preemptions and manager.num_used_blocks == 0
    assert 0 < engine.stats.num_spec_accepted_tokens < engine.stats.num_spec_draft_tokens



def test_a_prefix_hits_on_every_block_of_the_full_group_and_the_window_of_each_sliding_group(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": PROMPTS[0] + [1]}], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 24  # six blocks: in the full group's kind and the sliding groups' kind


def test_greedy_samples_forked_in_both_kinds_of_page_continue_as_transformers(llm, expected):
    # n > 1 must sample (vLLM's rule): at temperature 1e-4 a draw leaves the argmax only for logits within ~1e-3 of
    # it, and the seed fixes the draws
    params = SamplingParams(temperature=1e-4, seed=0, n=2, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[e, e] for e in expected[:2]]
