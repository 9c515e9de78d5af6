"""Speculative decoding with a draft model (tiny random models, float32): greedy outputs exactly the plain engine's
with the target drafting for itself (every draft accepted, exact draft-model work) and with another random model
(most drafts rejected); long prompts, the prefix cache, forks, preemption, sampling; a draft of another
vocabulary refused (the config's errors are tested in test_spec_decode.py)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from jaxserve import SamplingParams
from jaxserve.testing.tiny_models import make_tiny_model
from tests.generation_fixtures import BUCKETS, llm_on_buckets, record_planned_ahead, tokens_prompt

MIXED = "[mixed]\nbatch_sizes = [8]\ntoken_counts = [16, 32]\n"  # few executables: three engines and two drafts
K = 3
PROMPTS = [[5, 6, 7, 8, 9] * 4, [20, 21, 22, 23, 30, 31], [40 + (j * 7) % 50 for j in range(45)], [3, 4]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _llm(model_dir, tmp_path, name, draft_dir=None, disable_by_batch_size=8, **kwargs):
    spec = None if draft_dir is None else {"model": str(draft_dir), "num_speculative_tokens": K,
                                           "disable_by_batch_size": disable_by_batch_size}
    return llm_on_buckets(model_dir, tmp_path, name, BUCKETS + MIXED, strict_no_compile=True,
                          speculative_config=spec, **kwargs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", "llama", seed=3)


@pytest.fixture(scope="module")
def llms(model_dir, tmp_path_factory):
    """(no speculation, the target drafting for itself, a one-layer random draft while at most two sequences run,
    with steps planned ahead while more run)."""
    tmp = tmp_path_factory.mktemp("buckets")
    other = make_tiny_model(tmp / "draft", "llama", seed=8, num_hidden_layers=1, hidden_size=32)
    other_draft = _llm(model_dir, tmp, "other", other, disable_by_batch_size=2, async_scheduling=True)
    return _llm(model_dir, tmp, "plain"), _llm(model_dir, tmp, "self", model_dir), other_draft


def _generate(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate([tokens_prompt(p) for p in prompts], params, use_tqdm=False)]


def _counts(llm):
    stats, proposer = llm.llm_engine.stats, llm.llm_engine.proposer
    return np.array([stats.num_spec_drafts, stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens,
                     proposer.num_steps, proposer.num_fed_tokens])


def test_drafting_for_itself_every_draft_is_accepted_and_the_draft_feeds_each_token_once(llms):
    """One request: the first fill feeds the prompt and the prefill's token; every later fill feeds the last draft
    (accepted, never fed) and the bonus token, then decodes K - 1 drafts."""
    plain, spec, _ = llms
    prompt, params = PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    before = _counts(spec)
    assert _generate(spec, [prompt], params) == _generate(plain, [prompt], params)
    drafts, draft_tokens, accepted, steps, fed = _counts(spec) - before
    # 1 token from the prefill, then 4 a step (K drafts and the bonus token) up to 25
    assert (drafts, draft_tokens, accepted) == (6, 6 * K, 6 * K)
    assert steps == 6 * K  # a catch-up step and K - 1 decode steps per fill
    assert fed == len(prompt) + 1 + 2 * 5
    assert spec.llm_engine.stats.num_compiles_after_warm_up == 0


def test_long_prompts_catch_up_over_several_steps_and_every_draft_is_still_accepted(llms):
    """PROMPTS[2] (45 tokens) is longer than the largest mixed bucket (32 tokens): its first fill takes several
    steps. Every position of each sequence is fed to the draft once, by a catch-up step or as a draft (not the
    last draft of a fill), up to the last step's two tokens (its last draft and the bonus token)."""
    plain, spec, _ = llms
    before = _counts(spec)
    assert _generate(spec, PROMPTS, GREEDY) == _generate(plain, PROMPTS, GREEDY)
    drafts, draft_tokens, accepted, steps, fed = _counts(spec) - before
    assert accepted == draft_tokens > 0
    assert fed + draft_tokens - drafts == sum(len(p) + GREEDY.max_tokens - 2 for p in PROMPTS)


def test_another_draft_model_keeps_the_greedy_tokens_of_the_plain_engine(llms):
    """Until two of the four requests end, steps are planned ahead without drafts; then the draft catches up on the
    tokens of the two left and drafts for them."""
    plain, _, other = llms
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (30, 12, 30, 12)]
    before = _counts(other)
    planned_ahead = record_planned_ahead(other.llm_engine)
    expected = plain.generate([tokens_prompt(p) for p in PROMPTS], params, use_tqdm=False)
    got = other.generate([tokens_prompt(p) for p in PROMPTS], params, use_tqdm=False)
    assert 0 < sum(planned_ahead) < len(planned_ahead)
    for a, b in zip(expected, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert list(x) == list(y)
    drafts, draft_tokens, accepted, _, _ = _counts(other) - before
    assert draft_tokens > 3 * len(PROMPTS) and accepted < draft_tokens / 2  # another model: mostly rejected


def test_prefix_cache_hits_and_forks_keep_every_draft_right(llms):
    """The second run hits the cached prompt blocks (the draft feeds its prompt again, into the shared blocks);
    n = 2 samples of top_k = 1 (the greedy tokens) fork the sequence (copy-on-write of the shared last block)."""
    plain, spec, _ = llms
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # two full blocks of 8 and two tokens
    expected = _generate(plain, [prompt], GREEDY)
    hits = spec.llm_engine.block_manager.prefix_cache_stats.hits
    before = _counts(spec)
    assert _generate(spec, [prompt], GREEDY) == expected
    assert _generate(spec, [prompt], GREEDY) == expected
    assert spec.llm_engine.block_manager.prefix_cache_stats.hits > hits
    forked = spec.generate([tokens_prompt(prompt)], SamplingParams(n=2, top_k=1, max_tokens=24,
                                                                   ignore_eos=True), use_tqdm=False)
    assert [c.token_ids for c in forked[0].outputs] == expected * 2
    _, draft_tokens, accepted, _, _ = _counts(spec) - before
    assert accepted == draft_tokens > 0


def test_preemption_releases_the_draft_state(llms):
    """Eight sequences of up to 120 tokens in a pool of 512: preempted sequences recompute, and the draft feeds them
    again from their first position."""
    plain, spec, _ = llms
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(60)] for i in range(8)]
    preemptions, before = spec.llm_engine.stats.num_preemptions, _counts(spec)
    assert _generate(spec, prompts, params) == _generate(plain, prompts, params)
    assert spec.llm_engine.stats.num_preemptions > preemptions
    _, draft_tokens, accepted, _, _ = _counts(spec) - before
    assert accepted == draft_tokens > 0
    assert spec.llm_engine.proposer._kv == {}  # every sequence released


def test_sampled_tokens_are_distributed_as_without_speculation(llms):
    """300 seeds at temperature 1 with top-k: each output position's tokens against the plain engine's (chi-square),
    with the target's greedy tokens as drafts (accepted at some positions, rejected at others)."""
    plain, other, _ = llms
    prompt = PROMPTS[0]
    params = [SamplingParams(temperature=1.0, top_k=6, seed=seed, max_tokens=4, ignore_eos=True) for seed in range(300)]
    before = _counts(other)
    tokens = [np.array(_generate(llm, [prompt] * 300, params)) for llm in (plain, other)]
    _, draft_tokens, accepted, _, _ = _counts(other) - before
    assert 20 <= accepted < 0.9 * draft_tokens
    for position in range(1, 4):  # position 0 comes from the prefill step, without drafts
        values = np.union1d(tokens[0][:, position], tokens[1][:, position])
        table = np.array([[np.sum(t[:, position] == v) for v in values] for t in tokens])
        common = table.sum(axis=0) >= 10
        table = np.column_stack([table[:, common], table[:, ~common].sum(axis=1)])
        assert chi2_contingency(table[:, table.sum(axis=0) > 0]).pvalue > 1e-3


def test_a_draft_model_of_another_vocabulary_is_refused(model_dir, tmp_path):
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, vocab_size=300)
    with pytest.raises(ValueError) as info:
        _llm(model_dir, tmp_path, "vocab", draft)
    assert str(info.value) == (f"speculative_config: the draft model {draft} has a vocabulary of 300 tokens, the "
                               "target's has 320: a draft model must share the target's vocabulary")
