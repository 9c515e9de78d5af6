"""Mixed steps (decode rows and prefill chunks in one ragged step) change no token: every generation feature
on a grid with `[mixed]` buckets gives exactly what the same engine gives on prefill-or-decode steps."""

from __future__ import annotations

import asyncio
import collections
import dataclasses

import numpy as np
import pytest

from jaxserve import LLM, AsyncLLMEngine, SamplingParams
from jaxserve.engine.step_trace import TRACE_ENV, StepTrace
from jaxserve.sampling_params import BeamSearchParams
from jaxserve.testing.tiny_models import make_tiny_model
from tests.generation_fixtures import BUCKETS, NUM_KV_BLOCKS, llm_on_buckets, tokens_prompt
from tests.paths import load_script

trace_steps = load_script("trace_steps")

MIXED = "[mixed]\nbatch_sizes = [4, 8]\ntoken_counts = [16, 32]\n"
LENGTHS = [3, 40, 9, 70, 5, 17, 26, 1]
PROMPTS = [tokens_prompt([(7 * i + j) % 90 + 3 for j in range(n)]) for i, n in enumerate(LENGTHS)]


def _llm(model_dir, tmp_path, name: str, buckets: str, num_kv_blocks: int = NUM_KV_BLOCKS, **kwargs) -> LLM:
    """Without the prefix cache, which would serve the prompts every test repeats: the tests here count the
    mixed steps their prefills make (tests/engine/test_prefix_caching.py runs the cache on mixed steps)."""
    return llm_on_buckets(model_dir, tmp_path, name, buckets, num_kv_blocks=num_kv_blocks, strict_no_compile=True,
                          enable_prefix_caching=False, **kwargs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", "llama", seed=3)


@pytest.fixture(scope="module")
def llms(model_dir, tmp_path_factory):
    """(prefill-or-decode engine, mixed-step engine) over the same tiny model."""
    tmp = tmp_path_factory.mktemp("buckets")
    return _llm(model_dir, tmp, "legacy", BUCKETS), _llm(model_dir, tmp, "mixed", BUCKETS + MIXED)


def _run(llm: LLM, prompts, params):
    stats = llm.llm_engine.stats
    before = stats.num_mixed_steps
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, stats.num_mixed_steps - before


def _assert_same_logprobs(a: list | None, b: list | None) -> None:
    assert (a is None) == (b is None)
    for x, y in zip(a or [], b or [], strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert list(x) == list(y)
            np.testing.assert_allclose([v.logprob for v in x.values()], [v.logprob for v in y.values()], atol=1e-4)


def test_greedy_tokens_logprobs_and_prompt_logprobs_equal_prefill_or_decode_steps(llms):
    legacy, mixed = llms
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    expected, legacy_mixed_steps = _run(legacy, PROMPTS, params)
    got, mixed_steps = _run(mixed, PROMPTS, params)
    assert legacy_mixed_steps == 0 and mixed_steps >= 5
    for a, b in zip(expected, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        _assert_same_logprobs(a.outputs[0].logprobs, b.outputs[0].logprobs)
        _assert_same_logprobs(a.prompt_logprobs, b.prompt_logprobs)
    assert mixed.llm_engine.stats.num_compiles_after_warm_up == 0


def test_seeded_sampling_with_penalties_bias_and_n_equals_prefill_or_decode_steps(llms):
    legacy, mixed = llms
    params = [
        SamplingParams(temperature=1.0, seed=11 + i, max_tokens=10, ignore_eos=True, n=2 if i % 3 == 0 else 1,
                       presence_penalty=0.5, repetition_penalty=1.3, frequency_penalty=0.2,
                       logit_bias={5: 3.0}, min_tokens=4, top_k=20, top_p=0.9)
        for i in range(len(PROMPTS))
    ]
    expected, _ = _run(legacy, PROMPTS, params)
    got, mixed_steps = _run(mixed, PROMPTS, params)
    assert mixed_steps > 0
    for a, b in zip(expected, got, strict=True):
        assert [o.token_ids for o in b.outputs] == [o.token_ids for o in a.outputs]


def test_beam_search_equals_prefill_or_decode_steps(llms):
    legacy, mixed = llms
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    expected = legacy.beam_search(PROMPTS[:4], params)
    before = mixed.llm_engine.stats.num_mixed_steps
    got = mixed.beam_search(PROMPTS[:4], params)
    assert mixed.llm_engine.stats.num_mixed_steps > before
    for a, b in zip(expected, got, strict=True):
        assert [s.tokens for s in b.sequences] == [s.tokens for s in a.sequences]
        np.testing.assert_allclose([s.cum_logprob for s in b.sequences], [s.cum_logprob for s in a.sequences],
                                   atol=1e-4)


def _trace(llm: LLM, params: SamplingParams) -> dict[str, list[int]]:
    """Two requests decode; three more arrive over the next steps, one long enough for several chunks."""
    engine = llm.llm_engine
    arrivals = {0: [0, 2], 3: [3], 4: [1, 5]}
    finished = {}
    for step in range(500):
        for i in arrivals.get(step, []):
            engine.add_request(f"r{i}", PROMPTS[i], params)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests() and step > max(arrivals):
            return finished
    raise AssertionError("the trace did not finish")


def test_the_step_trace_has_a_line_for_every_step_the_engine_counts(llms, tmp_path, monkeypatch):
    _, mixed = llms
    engine, path = mixed.llm_engine, tmp_path / "trace.jsonl"
    assert StepTrace.from_env() is None  # off unless the environment names a file
    monkeypatch.setenv(TRACE_ENV, str(path))
    engine.step_trace = StepTrace.from_env()
    before = dataclasses.replace(engine.stats)
    try:
        _trace(mixed, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
    finally:
        engine.step_trace.close()
        engine.step_trace = None
    stats = engine.stats
    records = trace_steps.read_trace(path)
    kinds = collections.Counter(r["kind"] for r in records)
    assert len(records) == stats.num_steps - before.num_steps
    assert kinds == {"mixed": stats.num_mixed_steps - before.num_mixed_steps,
                     "prefill": stats.num_prefill_steps - before.num_prefill_steps,
                     "decode": stats.num_decode_steps - before.num_decode_steps}
    assert sum(r["prefill_tokens"] for r in records) == stats.num_prefill_tokens - before.num_prefill_tokens == sum(
        LENGTHS[i] for i in (0, 1, 2, 3, 5))
    assert sum(r["padded_tokens"] for r in records) == stats.num_padded_tokens - before.num_padded_tokens
    assert all(r["launched"] <= r["ready"] for r in records)
    itls = trace_steps._itls(trace_steps.with_gaps(records, idle_s=0.05))
    assert len(itls) == sum(r["decode_rows"] for r in records) and np.all(itls > 0)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_requests_arriving_while_others_decode_get_the_same_tokens(llms, async_scheduling, monkeypatch):
    legacy, mixed = llms
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    expected = _trace(legacy, params)
    engine = mixed.llm_engine
    monkeypatch.setattr(engine, "async_scheduling", async_scheduling)  # the engine's own mode comes back after
    before = engine.stats.num_mixed_steps
    assert _trace(mixed, params) == expected
    assert engine.stats.num_mixed_steps - before >= 4
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_async_engine_streams_on_mixed_steps_the_tokens_of_the_offline_engine(llms):
    legacy, mixed = llms
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in _run(legacy, PROMPTS, params)[0]]
    engine = AsyncLLMEngine(mixed.llm_engine)

    async def one(i: int) -> list[int]:  # all at once: the first prefills alone, the rest join its decoding
        outputs = [out async for out in engine.generate(PROMPTS[i], params, f"async-{i}")]
        return outputs[-1].outputs[0].token_ids

    async def all_requests():
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    before = mixed.llm_engine.stats.num_mixed_steps
    assert asyncio.run(all_requests()) == expected
    assert mixed.llm_engine.stats.num_mixed_steps > before


def test_preemption_on_mixed_steps_keeps_every_token(model_dir, tmp_path, llms):
    legacy, _ = llms
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = PROMPTS[:6]
    expected = [o.outputs[0].token_ids for o in _run(legacy, prompts, params)[0]]
    small = _llm(model_dir, tmp_path, "small", BUCKETS + MIXED, num_kv_blocks=24)  # 192 tokens for ~330 wanted
    outputs, mixed_steps = _run(small, prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert mixed_steps > 0 and small.llm_engine.stats.num_preemptions > 0


@pytest.mark.parametrize("backend", ["reference"])
def test_other_attention_backends_on_mixed_steps_give_the_same_tokens(model_dir, tmp_path, llms, backend):
    legacy, _ = llms
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    expected, _ = _run(legacy, PROMPTS, params)
    other = _llm(model_dir, tmp_path, backend, BUCKETS + MIXED, attention_backend=backend)
    got, mixed_steps = _run(other, PROMPTS, params)
    assert mixed_steps > 0
    for a, b in zip(expected, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        _assert_same_logprobs(a.prompt_logprobs, b.prompt_logprobs)


def test_a_latency_target_learns_the_served_mixed_steps_costs_and_changes_no_token(model_dir, llms, tmp_path):
    """`max_itl_ms`: nothing is timed at start-up; every mixed step served is timed into the step costs the
    scheduler's budget follows (nothing compiles after warm-up), and greedy tokens stay those of
    prefill-or-decode steps."""
    legacy, _ = llms
    targeted = _llm(model_dir, tmp_path, "targeted", BUCKETS + MIXED, max_itl_ms=60_000.0)
    budget = targeted.llm_engine.scheduler.step_budget
    assert budget.max_itl_ms == 60_000.0 and budget.costs.num_observed == 0 and not budget.follows_target
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected, _ = _run(legacy, PROMPTS, params)
    got, mixed_steps = _run(targeted, PROMPTS, params)
    assert mixed_steps > 0 and [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert budget.costs.num_observed == targeted.llm_engine.stats.num_mixed_steps
    assert targeted.llm_engine.stats.num_compiles_after_warm_up == 0


@pytest.mark.parametrize("bad", [0.0, -1.0, True])
def test_max_itl_ms_must_be_a_positive_number(bad):
    from jaxserve.config.engine_config import EngineConfig

    with pytest.raises(ValueError, match="max_itl_ms must be a positive number of milliseconds"):
        EngineConfig(max_itl_ms=bad)
