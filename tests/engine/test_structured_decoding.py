"""Structured outputs in the engine (tiny random model, byte-level tokenizer): with async scheduling a step
with a constrained row whose grammar waits for the token still in flight is sampled once its masks are known
(`LLMEngine._resample`), and that gives exactly the tokens and logprobs of an engine that reads every step
before planning the next and masks rows in the step. Unconstrained rows of the same batches keep their
tokens; nothing compiles after warm-up (strict_no_compile). A constraint with a `reasoning_end` marker leaves
the tokens up to the marker free and constrains those after it."""

from __future__ import annotations

import re

import pytest

from jaxserve import LLM, SamplingParams, StructuredOutputsParams
from jaxserve.runner.input_batch import SampleShape
from jaxserve.testing.tiny_models import make_tiny_model
from tests.generation_fixtures import BUCKETS, LETTERS, llm_on_buckets, tokens_prompt

MIXED = "[mixed]\nbatch_sizes = [4, 8]\ntoken_counts = [16, 32]\n"  # decode rows ride along every prefill chunk
EMAIL = r"[a-j]{3,6}@(ab|cd)\.com"
CHOICES = ["alpha", "beta", "gamma"]
EMAIL_RULE = StructuredOutputsParams(regex=EMAIL)
CHOICE_RULE = StructuredOutputsParams(choice=CHOICES)
PROMPTS = [[1, 70, 71, 72, 73, 74], [1, 80, 81], [1, 90, 91, 92, 93, 94, 95, 96, 97, 98], [1, 75]]


def _llm(model_dir, tmp_path, name: str, **kwargs) -> LLM:
    return llm_on_buckets(model_dir, tmp_path, name, BUCKETS + MIXED, strict_no_compile=True,
                          compile_cache_dir=str(tmp_path / "compile_cache"), **kwargs)


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    """(async scheduling, every step read before the next is planned)."""
    tmp = tmp_path_factory.mktemp("structured")
    model_dir = make_tiny_model(tmp / "model", "llama", seed=4)
    return _llm(model_dir, tmp, "async", async_scheduling=True), _llm(model_dir, tmp, "sync", async_scheduling=False)


def _requests() -> list[tuple[list[int], SamplingParams]]:
    """Constrained rows (sampled at temperature 1, greedy, with logprobs, cut by max_tokens mid-grammar) and
    unconstrained ones, in one batch."""
    return [
        *[(PROMPTS[seed], SamplingParams(temperature=1.0, seed=seed, max_tokens=32,
                                         structured_outputs=EMAIL_RULE)) for seed in range(4)],
        (PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=CHOICE_RULE)),
        (PROMPTS[2], SamplingParams(temperature=1.0, seed=11, max_tokens=16, logprobs=2,
                                    structured_outputs=CHOICE_RULE)),
        (PROMPTS[3], SamplingParams(temperature=1.0, seed=5, max_tokens=5,
                                    structured_outputs=StructuredOutputsParams(regex="[a-j]{20}"))),
        (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
        (PROMPTS[2], SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=1)),
    ]


def _run(llm: LLM, requests) -> list:
    prompts, params = zip(*requests, strict=True)
    return [o.outputs[0] for o in llm.generate([tokens_prompt(p) for p in prompts], list(params), use_tqdm=False)]


def test_steps_sampled_after_their_masks_equal_steps_masked_in_place(llms):
    asynchronous, synchronous = llms
    requests = _requests()
    ours, reference = _run(asynchronous, requests), _run(synchronous, requests)
    assert [o.token_ids for o in ours] == [o.token_ids for o in reference]
    assert [o.finish_reason for o in ours] == [o.finish_reason for o in reference]
    for mine, theirs in zip(ours, reference, strict=True):
        assert (mine.logprobs is None) == (theirs.logprobs is None)
        for a, b in zip(mine.logprobs or [], theirs.logprobs or [], strict=True):
            assert a.keys() == b.keys()
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) and a[t].rank == b[t].rank for t in a)
    emails, (choice_greedy, choice_sampled), cut, plain = ours[:4], ours[4:6], ours[6], ours[7:]
    assert all(re.fullmatch(EMAIL, o.text) for o in emails), [o.text for o in emails]
    assert len({o.text for o in emails}) > 1  # sampled, not one greedy answer
    assert choice_greedy.text in CHOICES and choice_sampled.text in CHOICES
    assert all(o.finish_reason == "stop" for o in [*emails, choice_greedy, choice_sampled])
    assert re.fullmatch("[a-j]{5}", cut.text) and cut.finish_reason == "length"  # the last token is masked too
    # every constrained token after a sequence's first waited for its mask, which was filled after its step was
    # dispatched; those steps were sampled once the masks were known
    constrained, stats = ours[:7], asynchronous.llm_engine.stats
    assert stats.num_late_masks == sum(len(o.token_ids) - 1 for o in constrained)
    assert max(len(o.token_ids) for o in constrained) - 1 <= stats.num_late_sampled_steps < stats.num_steps
    assert (synchronous.llm_engine.stats.num_late_masks, synchronous.llm_engine.stats.num_late_sampled_steps) == (0, 0)
    alone = _run(asynchronous, requests[7:])
    assert [o.token_ids for o in plain] == [o.token_ids for o in alone]


def test_one_sampler_executable_per_batch_size_samples_every_step_and_resamples_late_masks(llms, monkeypatch):
    """Steps give their logits and the sampler executable of their batch size samples them (compiled once per
    batch size, not into every step): each engine holds exactly one per batch size of its steps, and a
    synchronous engine switched to async scheduling resamples its late-masked steps with them, compiling nothing."""
    asynchronous, synchronous = llms
    for runner in (asynchronous.llm_engine.runner, synchronous.llm_engine.runner):
        assert {shape.batch_size for shape in runner.executables} == {1, 4, 8}
        assert set(runner.sampler_executables) == {SampleShape(1), SampleShape(4), SampleShape(8)}
    engine = synchronous.llm_engine
    num_compiles = engine.runner.num_compiles
    monkeypatch.setattr(engine, "async_scheduling", True)
    late_sampled = engine.stats.num_late_sampled_steps
    requests = _requests()
    assert [o.token_ids for o in _run(synchronous, requests)] == [o.token_ids for o in _run(asynchronous, requests)]
    assert engine.stats.num_late_sampled_steps > late_sampled
    assert engine.stats.num_compiles_after_warm_up == 0 and engine.runner.num_compiles == num_compiles


def test_an_abort_while_a_resample_is_pending_loses_nothing_else(llms):
    llm = llms[0].llm_engine
    requests = _requests()
    for i, (prompt, params) in enumerate(requests):
        llm.add_request(str(i), tokens_prompt(prompt), params)
    finished = {}
    steps = 0
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
        steps += 1
        if steps == 4:
            assert llm.abort_request("0") is not None
            assert llm.abort_request("4") is not None
    assert sorted(finished, key=int) == [str(i) for i in range(len(requests)) if i not in (0, 4)]
    expected = _run(llms[1], [r for i, r in enumerate(requests) if i not in (0, 4)])
    assert [finished[k].token_ids for k in sorted(finished, key=int)] == [o.token_ids for o in expected]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_a_constraint_waits_for_the_output_to_hold_its_reasoning_end(llms):
    """Greedy over the letters a-j (a logit bias keeps the free text readable): with a marker taken from the free
    output, the output is the free output up to the marker's end, then the one choice; with a marker the output
    never holds, it is the free output, whole. The same with async scheduling (each waiting row's step sampled
    once its previous token is read, without a mask) and without, in one batch with an unconstrained row."""
    letters = {token: 100.0 for token in LETTERS.values()}
    greedy = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "logit_bias": letters}
    (free,) = _run(llms[1], [(PROMPTS[0], SamplingParams(**greedy))])
    marker = free.text[4:7]
    end = free.text.index(marker) + len(marker)

    def waiting(marker: str) -> SamplingParams:
        return SamplingParams(**greedy, structured_outputs=StructuredOutputsParams(choice=["beta"],
                                                                                   reasoning_end=marker))

    requests = [(PROMPTS[0], waiting(marker)), (PROMPTS[0], waiting("zzz")), (PROMPTS[2], SamplingParams(**greedy))]
    for llm in llms:
        after_marker, never, plain = _run(llm, requests)
        assert (after_marker.text, after_marker.finish_reason) == (free.text[:end] + "beta", "stop")
        assert after_marker.token_ids[:end] == free.token_ids[:end]
        assert (never.text, never.token_ids, never.finish_reason) == (free.text, free.token_ids, "length")
        assert plain.text == _run(llm, requests[2:])[0].text
