"""KV cache groups in the engine (tiny random Gemma 3: a full-attention layer between two sliding ones of window 5,
so three groups of one layer): greedy tokens equal transformers through n-gram drafts and their rejections,
prefix-cache hits and preemptions, while the sliding groups give back the blocks their windows left; sampling with
n > 1 and beam search give the tokens of the same engine without groups (`disable_hybrid_kv_cache_manager`), which
at the same KV memory has a third of the blocks."""

from __future__ import annotations

import json

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config.kv_cache_groups import NULL_BLOCK, first_kept_token
from jaxserve.sampling_params import BeamSearchParams
from jaxserve.testing.hf_reference import hf_greedy
from jaxserve.testing.tiny_models import make_tiny_model
from tests.models.test_family_engines import BUCKETS

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[5, 6, 7, 8, 9] * 5, [20, 21, 22] * 7, list(range(40, 63)), [3, 4, 5]]  # repetitive: n-gram drafts
MAX_TOKENS = 24
KV_BLOCKS = 20  # of every layer: a block of 4 tokens per layer of the one-group engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gemma3") / "model", "gemma3", seed=5)


@pytest.fixture(scope="module")
def llms(model_dir, tmp_path_factory):
    """(the engine with KV cache groups, the same engine without), n-gram drafts and prefix caching on, both with
    the KV memory of 48 blocks of every layer."""
    buckets = tmp_path_factory.mktemp("buckets") / "buckets.toml"
    buckets.write_text(BUCKETS.format(block_size=4))  # 4-token blocks: the windows of 5 span few
    config = json.loads((model_dir / "config.json").read_text())
    token_bytes = 2 * config["num_key_value_heads"] * config["head_dim"] * 4  # K and V of a layer, float32
    common = dict(dtype="float32", buckets=str(buckets), max_model_len=64, max_num_seqs=4, speculative_config=NGRAM,
                  enable_prefix_caching=True, kv_cache_memory_bytes=KV_BLOCKS * 4 * 3 * token_bytes)
    return LLM(str(model_dir), **common), LLM(str(model_dir), disable_hybrid_kv_cache_manager=True, **common)


def test_the_same_memory_holds_three_times_the_blocks_in_groups_of_one_layer(llms):
    groups, one_group = (llm.llm_engine for llm in llms)
    assert groups.block_manager.group_windows == (None, 5, 5)
    assert one_group.block_manager.group_windows == (None,)
    assert (groups.grid.num_blocks, one_group.grid.num_blocks) == (3 * KV_BLOCKS, KV_BLOCKS)


def test_greedy_tokens_equal_transformers_through_drafts_preemptions_and_cache_hits(llms, model_dir):
    groups = llms[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)  # no EOS: as transformers
    expected = [hf_greedy(model_dir, p, MAX_TOKENS) for p in PROMPTS]
    for llm in llms:
        before = llm.llm_engine.stats.num_preemptions
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS * 2], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected * 2
        assert llm.llm_engine.stats.num_preemptions > before  # both pools are tight
    stats = groups.llm_engine.stats
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens  # drafts were accepted and rejected


def test_a_prefix_hits_on_every_block_of_the_full_group_and_the_window_of_each_sliding_group(llms):
    groups = llms[0]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    groups.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    again = groups.generate([{"prompt_token_ids": PROMPTS[0] + [1]}], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 24  # six blocks: the sliding groups' blocks 4 and 5 (tokens 16 on) among them


def test_sliding_groups_keep_only_what_their_window_reaches(llms):
    engine = llms[0].llm_engine
    manager = engine.block_manager
    engine.add_request("long", {"prompt_token_ids": list(range(40, 63))},
                       SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    seen_null = False
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            full, *sliding = seq.block_tables
            kept = first_kept_token(5, seq.num_computed_tokens) // 4
            assert NULL_BLOCK not in full
            # what the window left is given back as the next step is planned: until then at most the blocks the last
            # step's tokens moved past (two after the first 16-token chunk, one after a decode row and its 3 drafts)
            for table in sliding:
                assert sum(block != NULL_BLOCK for block in table[:kept]) <= 2
                seen_null |= NULL_BLOCK in table
    assert seen_null and manager.num_used_blocks == 0


def test_samples_and_beams_equal_the_engine_without_groups(llms):
    assert_samples_and_beams_agree(llms)


def assert_samples_and_beams_agree(llms) -> None:
    """Two engines give the same n = 2 samples of three prompts and the same beams (width 2) of two."""
    sampled = SamplingParams(temperature=1.0, n=2, seed=7, max_tokens=12)
    beams = BeamSearchParams(beam_width=2, max_tokens=8)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    samples = [[c.token_ids for o in llm.generate(prompts, sampled, use_tqdm=False) for c in o.outputs]
               for llm in llms]
    assert samples[0] == samples[1] and len(samples[0]) == 6
    searched = [beam_search_without_drafts(llm, prompts[:2], beams) for llm in llms]
    assert searched[0] == searched[1] and len(searched[0]) == 4


def beam_search_without_drafts(llm, prompts, params) -> list[list[int]]:
    """The beams' tokens of a beam search on ``llm`` with its proposer detached (beam search takes no drafts)."""
    engine = llm.llm_engine
    proposer, engine.proposer = engine.proposer, None
    try:
        return [beam.tokens for output in llm.beam_search(prompts, params) for beam in output.sequences]
    finally:
        engine.proposer = proposer
