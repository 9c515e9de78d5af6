"""Automatic prefix caching in the engine (tiny random model): every generation feature gives exactly the
tokens of the same engine without caching; hits, evictions, preemptions and aborts are counted exactly and
leave every block free or evictable; nothing compiles after warm-up (strict_no_compile)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.sampling_params import BeamSearchParams
from jaxserve.testing.tiny_models import make_tiny_model
from tests.generation_fixtures import BUCKETS, NUM_KV_BLOCKS, llm_on_buckets, tokens_prompt

MIXED = "[mixed]\nbatch_sizes = [4, 8]\ntoken_counts = [16, 32]\n"
BS = 8  # BUCKETS' block size


def _llm(model_dir, tmp_path, name: str, *, caching: bool, num_kv_blocks: int = NUM_KV_BLOCKS, **kwargs) -> LLM:
    """Engines of one pool size share their executables through the module's compile cache."""
    return llm_on_buckets(model_dir, tmp_path, name, BUCKETS + MIXED, num_kv_blocks=num_kv_blocks,
                          strict_no_compile=True, enable_prefix_caching=caching,
                          compile_cache_dir=str(model_dir.parent / "compile_cache"), **kwargs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", "llama", seed=5)


@pytest.fixture(scope="module")
def llms(model_dir, tmp_path_factory):
    """(no caching, caching with async scheduling, caching with every step read before the next)."""
    tmp = tmp_path_factory.mktemp("buckets")
    return (_llm(model_dir, tmp, "off", caching=False), _llm(model_dir, tmp, "on", caching=True, async_scheduling=True),
            _llm(model_dir, tmp, "sync", caching=True, async_scheduling=False))


@pytest.fixture(scope="module")
def small(model_dir, tmp_path_factory):
    """Caching on an 18-block pool (16 hold a max_model_len sequence): eviction and preemption. The eviction test
    runs first, on its fresh pool."""
    return _llm(model_dir, tmp_path_factory.mktemp("small"), "small", caching=True, num_kv_blocks=18)


def _random_tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, size=n).tolist()


def _greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def _tokens(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    outputs = llm.generate([tokens_prompt(p) for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _prefix_counters(llm: LLM) -> tuple[int, int, int]:
    """(prefix cache queries, hits, prefill tokens) so far, from the engine's stats snapshot."""
    stats = llm.llm_engine.make_stats()
    return stats.scheduler.prefix_cache_queries, stats.scheduler.prefix_cache_hits, stats.engine.num_prefill_tokens


def _all_free_or_evictable(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not np.any(bm.ref_counts)
    assert bm.prefix_cache.num_evictable == bm.prefix_cache.num_cached_blocks


@pytest.mark.parametrize("engine", [1, 2], ids=["async", "sync"])
def test_hit_counts_are_exact_for_a_constructed_sequence_of_requests(llms, engine):
    off, on = llms[0], llms[engine]
    a = _random_tokens(10 + engine, 40)
    a_out = _tokens(off, [a], _greedy(14))[0]  # a computes 40 + 13 tokens: 6 full blocks, the 6th of outputs
    requests = [  # (prompt, tokens expected from the cache)
        (a, 0),
        (a[:32] + _random_tokens(20 + engine, 5), 32),  # a's first 4 blocks
        (a, 32),  # never the block of the last token: 4 blocks, not 5
        (a + a_out[:10] + [5, 6, 7], 48),  # a's prompt and its first generated block
        (_random_tokens(30 + engine, 20), 0),
    ]
    before = _prefix_counters(on)
    for prompt, expected_cached in requests:
        output = on.generate([tokens_prompt(prompt)], _greedy(14), use_tqdm=False)[0]
        assert output.num_cached_tokens == expected_cached
        assert output.outputs[0].token_ids == _tokens(off, [prompt], _greedy(14))[0]
    num_tokens = sum(len(p) for p, _ in requests)
    num_hits = sum(n for _, n in requests)
    after = _prefix_counters(on)
    assert (after[0] - before[0], after[1] - before[1]) == (num_tokens, num_hits)
    assert after[2] - before[2] == num_tokens - num_hits
    assert off.generate([tokens_prompt(a)], _greedy(2), use_tqdm=False)[0].num_cached_tokens == 0
    assert _prefix_counters(off)[:2] == (0, 0)
    _all_free_or_evictable(on)


@pytest.mark.parametrize("engine", [1, 2], ids=["async", "sync"])
def test_a_shared_prefix_batch_gets_the_tokens_it_gets_without_caching(llms, engine):
    off, on = llms[0], llms[engine]
    system = _random_tokens(40 + engine, 45)
    prompts = [system + _random_tokens(50 + i, 3 + 7 * i) for i in range(6)]
    expected = _tokens(off, prompts, _greedy(12))
    outputs = on.generate([tokens_prompt(p) for p in prompts], _greedy(12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert sum(o.num_cached_tokens for o in outputs) >= 40  # later admissions start on the system prompt
    assert all(o.num_cached_tokens in (0, 40) for o in outputs)
    assert _tokens(on, prompts, _greedy(12)) == expected  # all of them again: every system block hits
    _all_free_or_evictable(on)


def test_every_generation_feature_on_a_cached_prefix(llms):
    """n > 1 and best_of forks, seeded sampling with penalties, logit_bias and min_tokens (the sampler slot starts
    with the counts of the cached tokens), beam search, logprobs; prompt_logprobs compute the whole prompt."""
    off, on = llms[0], llms[1]
    prompt = [7, 8, 9, 7, 8, 9] * 5 + _random_tokens(60, 20)  # repeated tokens: repetition penalty matters
    on.generate([tokens_prompt(prompt)], _greedy(4), use_tqdm=False)  # the prompt's blocks are cached now
    sampling = [
        SamplingParams(temperature=0.8, seed=3, n=3, best_of=4, max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, seed=4, max_tokens=12, ignore_eos=True, repetition_penalty=1.4,
                       frequency_penalty=0.5, presence_penalty=0.3, logit_bias={7: 2.0}, min_tokens=5),
        _greedy(8, repetition_penalty=2.0),
    ]
    for params in sampling:
        got, want = (llm.generate([tokens_prompt(prompt)], params, use_tqdm=False)[0] for llm in (on, off))
        assert got.num_cached_tokens == 48
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        assert [c.cumulative_logprob for c in got.outputs] == pytest.approx(
            [c.cumulative_logprob for c in want.outputs], abs=1e-4)
    beams = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    got, want = (llm.beam_search([tokens_prompt(prompt)], beams)[0] for llm in (on, off))
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    got, want = (llm.generate([tokens_prompt(prompt)], _greedy(3, prompt_logprobs=2), use_tqdm=False)[0]
                 for llm in (on, off))
    assert got.num_cached_tokens == 0
    assert [None if p is None else list(p) for p in got.prompt_logprobs] == [
        None if p is None else list(p) for p in want.prompt_logprobs]
    _all_free_or_evictable(on)


def test_eviction_under_a_tiny_pool_drops_the_least_recently_used_tail_first(small, llms):
    off = llms[0]
    a, b = _random_tokens(70, 40), _random_tokens(71, 110)
    params = _greedy(8)
    assert _tokens(small, [a], params) == _tokens(off, [a], params)  # a: 5 full blocks cached, 13 never-cached free
    cache = small.llm_engine.block_manager.prefix_cache
    a_blocks = [cache.block_of[0, h] for h in _hashes(small, a)]
    assert _tokens(small, [b], _greedy(10)) == _tokens(off, [b], _greedy(10))  # 15 blocks: 2 of a's are evicted
    assert [(0, h) in cache.block_of for h in _hashes(small, a)] == [True, True, True, False, False]
    a_tail = _hashes(small, a)[3:]
    assert all(cache.key_of.get(block, (0, None))[1] not in a_tail for block in a_blocks[3:])  # they held b's K/V since
    again = small.generate([tokens_prompt(a)], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 24  # a's head only: its tail's blocks never serve b's K/V as a's
    assert again.outputs[0].token_ids == _tokens(off, [a], params)[0]
    _all_free_or_evictable(small)


def _hashes(llm: LLM, prompt: list[int]) -> list[bytes]:
    from jaxserve.core.prefix_cache import hash_full_blocks
    from jaxserve.core.sequence import Sequence

    seq = Sequence("probe", prompt)
    return seq.block_hashes[: hash_full_blocks(seq, BS, len(prompt))]


def test_preemptions_and_aborts_leave_every_block_free_or_evictable(small, llms):
    off = llms[0]  # the small pool has 144 slots for the ~370 these requests want
    prompts = [_random_tokens(80 + i, n) for i, n in enumerate([40, 9, 70, 17, 26, 33])]
    params = SamplingParams(temperature=0.7, seed=9, max_tokens=30, ignore_eos=True, frequency_penalty=0.8)
    expected = _tokens(off, prompts, params)
    engine = small.llm_engine
    assert _tokens(small, prompts, params) == expected
    # unique prompts: every hit is a preempted sequence re-admitted on its own cached blocks
    assert engine.stats.num_preemptions > 0 and _prefix_counters(small)[1] > 0
    _all_free_or_evictable(small)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abort-{i}", tokens_prompt(prompt), params)
    for _ in range(6):
        engine.step()
    for i in range(0, len(prompts), 2):
        engine.abort_request(f"abort-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    _all_free_or_evictable(small)
    assert engine.stats.num_compiles_after_warm_up == 0


def test_turning_caching_off_computes_every_prompt(llms):
    off = llms[0]
    assert off.llm_engine.block_manager.prefix_cache is None
    prompt = _random_tokens(90, 30)
    before = off.llm_engine.stats.num_prefill_tokens
    outputs = off.generate([tokens_prompt(prompt)] * 2, _greedy(2), use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [0, 0]
    assert off.llm_engine.stats.num_prefill_tokens - before == 60


def test_the_periodic_stats_line_reports_the_prefix_cache_hit_rate(llms):
    from jaxserve.metrics.stat_logger import StatLogger

    on = llms[1]
    now = [0.0]
    stat_logger = StatLogger(on.llm_engine.make_stats(), interval=10.0, clock=lambda: now[0])
    prompt = _random_tokens(95, 33)
    for _ in range(2):  # 33 prompt tokens computed, then 1 (32 cached); 4 generated each
        on.generate([tokens_prompt(prompt)], _greedy(4), use_tqdm=False)
    now[0] = 5.0
    assert not stat_logger.is_due()
    now[0] = 10.0
    assert stat_logger.is_due()
    assert stat_logger.log(on.llm_engine.make_stats()) == (
        "Avg prompt throughput: 3.4 tokens/s, Avg generation throughput: 0.8 tokens/s, Running: 0 reqs, "
        "Waiting: 0 reqs, KV cache usage: 0.0%, Prefix cache hit rate: 48.5%")
