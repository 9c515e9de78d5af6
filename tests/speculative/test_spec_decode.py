"""Speculative decoding in the engine (tiny random model, float32): greedy outputs exactly those of the same engine
without it, with the n-gram proposer and with proposers whose drafts are known to be right or wrong (exact accept
counts); sampled outputs distributed as without it; penalties, stops, limits, n > 1, preemption, structured
outputs, the refused combinations and the metrics."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from prometheus_client import generate_latest
from scipy.stats import chi2_contingency

from jaxserve import SamplingParams, StructuredOutputsParams
from jaxserve.config.speculative_config import SpeculativeConfig
from jaxserve.engine.engine_builder import make_proposer
from jaxserve.metrics.prometheus import ServingMetrics
from jaxserve.metrics.stat_logger import StatLogger
from jaxserve.sampling_params import BeamSearchParams
from jaxserve.speculative.proposer import Proposer
from jaxserve.testing.tiny_models import make_tiny_model
from tests.generation_fixtures import BUCKETS, llm_on_buckets, record_planned_ahead, tokens_prompt

MIXED = "[mixed]\nbatch_sizes = [4, 8]\ntoken_counts = [32]\n"
K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
REPETITIVE = [[5, 6, 7, 8, 9] * 4, [20, 21, 22] * 6 + [20], [40 + (j % 7) for j in range(45)], [3, 4]]


def _llm(model_dir, tmp_path, name, **kwargs):
    return llm_on_buckets(model_dir, tmp_path, name, BUCKETS + MIXED, strict_no_compile=True, **kwargs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", "llama", seed=3)


@pytest.fixture(scope="module")
def llms(model_dir, tmp_path_factory):
    """(the engine without speculation, the same engine with n-gram speculation)."""
    tmp = tmp_path_factory.mktemp("buckets")
    return _llm(model_dir, tmp, "plain"), _llm(model_dir, tmp, "spec", speculative_config=NGRAM)


@pytest.fixture
def spec(llms):
    """The speculative engine with its n-gram proposer back after the test."""
    engine = llms[1].llm_engine
    proposer = engine.proposer
    yield llms[1]
    engine.proposer = proposer


class ReferenceProposer(Proposer):
    """Drafts a reference run's continuation of the prompt (right, as long as the sequence follows it), with the
    drafts at offsets ``wrong`` replaced by another token."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], wrong: tuple[int, ...] = ()):
        self.continuations = continuations
        self.wrong = wrong

    def propose(self, token_ids, max_drafts=None):
        for prompt, continuation in self.continuations.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                drafts = continuation[done : done + min(K, max_drafts)]
                return [(t + 1) % 300 if j in self.wrong else t for j, t in enumerate(drafts)]
        return []


def _generate(llm, prompts, params):
    return llm.generate([tokens_prompt(p) for p in prompts], params, use_tqdm=False)


def _spec_counts(llm):
    stats = llm.llm_engine.stats
    return stats.num_spec_drafts, stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens


def _delta(before, after):
    return tuple(b - a for a, b in zip(before, after, strict=True))


def _reference(plain, prompts, params) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, _generate(plain, prompts, params), strict=True)}


def test_ngram_speculation_gives_the_greedy_tokens_and_logprobs_of_the_plain_engine(llms):
    plain, spec = llms
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    before = _spec_counts(spec)
    expected, got = _generate(plain, REPETITIVE, params), _generate(spec, REPETITIVE, params)
    drafts, draft_tokens, accepted = _delta(before, _spec_counts(spec))
    assert drafts > 10 and accepted > 0  # a random model seldom repeats itself: the tests below accept more
    for a, b in zip(expected, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert list(x) == list(y)
            np.testing.assert_allclose([v.logprob for v in x.values()], [v.logprob for v in y.values()], atol=1e-4)
        assert [None if x is None else list(x) for x in b.prompt_logprobs] == [
            None if x is None else list(x) for x in a.prompt_logprobs]
    assert spec.llm_engine.stats.num_compiles_after_warm_up == 0


def test_right_drafts_are_all_accepted_and_a_step_yields_k_plus_one_tokens(llms, spec):
    plain, _ = llms
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompt = REPETITIVE[3]
    reference = _reference(plain, [prompt], params)
    spec.llm_engine.proposer = ReferenceProposer(reference)
    stats = spec.llm_engine.stats
    before, steps = _spec_counts(spec), stats.num_steps
    [output] = _generate(spec, [prompt], params)
    assert output.outputs[0].token_ids == reference[tuple(prompt)]
    # one prefill step for the first token, then 4 tokens a step (3 drafts and the bonus token) up to 29, then one
    # step without drafts: its last token has no room for a draft under max_tokens
    assert stats.num_steps - steps == 1 + 7 + 1
    assert _delta(before, _spec_counts(spec)) == (7, 7 * 3, 7 * 3)


def test_a_wrong_draft_keeps_the_drafts_before_it_and_the_target_token_in_its_place(llms, spec):
    plain, _ = llms
    params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True, logprobs=1)
    prompts = REPETITIVE[:2]
    expected = _generate(plain, prompts, params)
    spec.llm_engine.proposer = ReferenceProposer({tuple(p): o.outputs[0].token_ids for p, o in zip(
        prompts, expected, strict=True)}, wrong=(1,))
    per_position = list(spec.llm_engine.stats.spec_accepted_per_position)
    before = _spec_counts(spec)
    got = _generate(spec, prompts, params)
    for a, b in zip(expected, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert [list(x) for x in b.outputs[0].logprobs] == [list(x) for x in a.outputs[0].logprobs]
    drafts, draft_tokens, accepted = _delta(before, _spec_counts(spec))
    assert accepted == drafts  # exactly the first draft of every row: 2 tokens a step
    new_per_position = spec.llm_engine.stats.spec_accepted_per_position
    assert new_per_position[0] - per_position[0] == drafts and new_per_position[1:] == per_position[1:]


def test_penalties_bias_and_min_tokens_see_exactly_the_accepted_tokens(llms, spec):
    """Penalties change the greedy argmax with every token a sequence generated: a draft counted but rejected, or
    one uncounted too many, would change the tokens after it."""
    plain, _ = llms
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.4,
                            frequency_penalty=0.4, presence_penalty=0.3, logit_bias={7: 1.5}, min_tokens=6)
    prompts = REPETITIVE[:3]
    reference = _reference(plain, prompts, params)
    for wrong in [(), (1,), (0, 2)]:
        spec.llm_engine.proposer = ReferenceProposer(reference, wrong=wrong)
        got = _generate(spec, prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [reference[tuple(p)] for p in prompts]


def test_a_stop_inside_the_drafts_ends_the_output_where_the_plain_engine_ends_it(llms, spec):
    plain, _ = llms
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompt = REPETITIVE[0]
    reference = _reference(plain, [prompt], free)
    stop_token = reference[tuple(prompt)][9]
    spec.llm_engine.proposer = ReferenceProposer(reference)
    for params in [SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_token]),
                   SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_token],
                                  include_stop_str_in_output=True),
                   SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=["x"])]:
        [expected], [got] = _generate(plain, [prompt], params), _generate(spec, [prompt], params)
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        assert got.outputs[0].text == expected.outputs[0].text
        assert (got.outputs[0].finish_reason, got.outputs[0].stop_reason) == (
            expected.outputs[0].finish_reason, expected.outputs[0].stop_reason)


def test_sampled_tokens_are_distributed_as_without_speculation(llms, spec):
    """400 seeds at temperature 1 with top-k and top-p, drafting the greedy continuation (accepted at some
    positions, rejected at others): each output position's tokens against the plain engine's (chi-square)."""
    plain, _ = llms
    prompt = REPETITIVE[0]
    spec.llm_engine.proposer = ReferenceProposer(
        _reference(plain, [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
    params = [SamplingParams(temperature=1.0, top_k=6, top_p=0.9, seed=seed, max_tokens=4, ignore_eos=True)
              for seed in range(400)]
    before = _spec_counts(spec)
    tokens = [np.array([o.outputs[0].token_ids for o in _generate(llm, [prompt] * 400, params)])
              for llm in (plain, spec)]
    drafts, draft_tokens, accepted = _delta(before, _spec_counts(spec))
    assert 30 <= accepted < 0.9 * draft_tokens  # both paths, many times
    for position in range(1, 4):  # position 0 comes from the prefill step, without drafts
        values = np.union1d(tokens[0][:, position], tokens[1][:, position])
        table = np.array([[np.sum(t[:, position] == v) for v in values] for t in tokens])
        common = table.sum(axis=0) >= 10
        table = np.column_stack([table[:, common], table[:, ~common].sum(axis=1)])
        assert chi2_contingency(table[:, table.sum(axis=0) > 0]).pvalue > 1e-3
    assert not np.array_equal(tokens[0], tokens[1])  # other draws: not the same samples replayed


def test_seeded_requests_and_n_samples_are_reproducible(spec):
    params = SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=20, ignore_eos=True, top_p=0.95)
    first, second = (_generate(spec, REPETITIVE[:2], params) for _ in range(2))
    for a, b in zip(first, second, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert len(a.outputs) == 3 and all(len(c.token_ids) == 20 for c in a.outputs)


def test_preemption_disable_by_batch_size_and_async_scheduling_keep_every_token(model_dir, tmp_path, llms):
    """A pool too small for the batch (preemptions), drafts only while at most two sequences run, and async
    scheduling planning steps ahead while more run."""
    plain, _ = llms
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = REPETITIVE * 2
    expected = [o.outputs[0].token_ids for o in _generate(plain, prompts, params)]
    small = _llm(model_dir, tmp_path, "small", num_kv_blocks=16, async_scheduling=True,
                 speculative_config={**NGRAM, "disable_by_batch_size": 2})
    engine = small.llm_engine
    planned_ahead = record_planned_ahead(engine)
    got = [o.outputs[0].token_ids for o in _generate(small, prompts, params)]
    assert got == expected
    stats = engine.stats
    assert stats.num_preemptions > 0 and stats.num_spec_accepted_tokens > 0
    assert 0 < sum(planned_ahead) < len(planned_ahead) and not planned_ahead[-1]
    assert "(speculative: each samples a position per row and per draft, at most 3 drafts per row on 2 rows)" in (
        small.llm_engine.grid.format_table())


def test_structured_outputs_rows_get_no_drafts_and_keep_their_grammar(llms, spec):
    plain, _ = llms
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(
        regex="(ab){2,5}c"))
    before = _spec_counts(spec)
    [expected], [got] = _generate(plain, [REPETITIVE[0]], params), _generate(spec, [REPETITIVE[0]], params)
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert _delta(before, _spec_counts(spec)) == (0, 0, 0)


def test_beam_search_is_refused(llms):
    _, spec = llms
    with pytest.raises(ValueError, match=r"^beam search is not supported with speculative decoding"):
        spec.llm_engine.add_request("beams", tokens_prompt([3, 4]), BeamSearchParams(beam_width=2, max_tokens=4))


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "eagle", "num_speculative_tokens": 2},
     "speculative_config: method 'eagle' is not supported: EAGLE heads need trained weights that jaxserve cannot "
     "load yet"),
    ({"method": "ngrams", "num_speculative_tokens": 2},
     "speculative_config: method must be one of ngram, draft_model, suffix, got 'ngrams'"),
    ({"method": "ngram"}, "speculative_config: num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0},
     "speculative_config: num_speculative_tokens must be a positive integer, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "speculative_config: prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3},
     "speculative_config: unknown key(s) 'lookahead'; known: method, num_speculative_tokens, disable_by_batch_size, "
     "prompt_lookup_min, prompt_lookup_max, model, suffix_decoding_max_tree_depth, "
     "suffix_decoding_max_cached_requests, suffix_decoding_max_spec_factor, suffix_decoding_min_token_prob"),
    ('{"method": "ngram",', "speculative_config: not a JSON object: Expecting property name enclosed in double "
     "quotes: line 1 column 20 (char 19)"),
    ({"method": "draft_model", "num_speculative_tokens": 2},
     "speculative_config: method 'draft_model' needs the draft's path in 'model', got None"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "draft"},
     "speculative_config: 'model' apply to method 'draft_model', not 'ngram'"),
    ({"model": "draft", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "speculative_config: 'prompt_lookup_max' apply to method 'ngram', not 'draft_model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8},
     "speculative_config: 'suffix_decoding_max_tree_depth' apply to method 'suffix', not 'ngram'"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0},
     "speculative_config: num_speculative_tokens must be a positive integer, got 0"),
    ({"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 0},
     "speculative_config: suffix_decoding_max_tree_depth must be a positive integer, got 0"),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1},
     "speculative_config: suffix_decoding_max_cached_requests must be an integer >= 0, got -1"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": 0},
     "speculative_config: suffix_decoding_max_spec_factor must be a number > 0, got 0"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5},
     "speculative_config: suffix_decoding_min_token_prob must be a number in [0, 1], got 1.5"),
])
def test_bad_speculative_configs_name_the_problem(config, message):
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.parse(config)
    assert str(info.value) == message


def test_a_model_alone_means_the_draft_model_method():
    assert SpeculativeConfig.parse('{"model": "/m", "num_speculative_tokens": 4}') == SpeculativeConfig(
        "draft_model", 4, model="/m")


def test_vllm_defaults_for_the_n_gram_bounds():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}') == SpeculativeConfig(
        "ngram", 4, 5, 5)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}) == (
        SpeculativeConfig("ngram", 4, 3, 3))


def test_vllm_defaults_for_suffix_decoding():
    """num_speculative_tokens defaults to the tree depth, as in vLLM."""
    assert SpeculativeConfig.parse('{"method": "suffix"}') == SpeculativeConfig(
        "suffix", 24, suffix_decoding_max_tree_depth=24, suffix_decoding_max_cached_requests=10000,
        suffix_decoding_max_spec_factor=1.0, suffix_decoding_min_token_prob=0.1)
    deep = SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_max_tree_depth": 16})
    assert deep.num_speculative_tokens == 16


def test_suffix_decoding_drafts_an_earlier_response_and_keeps_the_greedy_tokens(llms, spec):
    """The first run drafts from the request's own tokens (a random model seldom repeats itself); the second run of
    the same prompt drafts the first one's response, kept in the global trie: every draft is accepted."""
    plain, _ = llms
    engine = spec.llm_engine
    config = dataclasses.replace(engine.config, speculative_config={"method": "suffix", "num_speculative_tokens": K})
    engine.proposer = proposer = make_proposer(config, engine.grid, None, engine.mesh)
    recorded, record_finished = [], proposer.record_finished
    proposer.record_finished = lambda seq_id, tokens: recorded.append(list(tokens)) or record_finished(seq_id, tokens)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = [11, 12, 13, 14]
    [expected] = _generate(plain, [prompt], params)
    counts = []
    for _ in range(2):
        before = _spec_counts(spec)
        [output] = _generate(spec, [prompt], params)
        assert output.outputs[0].token_ids == expected.outputs[0].token_ids
        counts.append(_delta(before, _spec_counts(spec)))
    (_, first_drafted, first_accepted), (_, drafted, accepted) = counts
    assert first_accepted < first_drafted and drafted == accepted >= 20
    assert proposer.num_cached_requests == 2
    # a sequence at max_tokens is released when its last step is dispatched: its response is what was read by then
    assert recorded == [list(expected.outputs[0].token_ids[:-1])] * 2


def test_metrics_count_drafts_with_vllm_names(spec):
    engine = spec.llm_engine
    metrics = ServingMetrics(engine.make_stats, lambda: 0)
    logger = StatLogger(engine.make_stats(), interval=0.0)
    _generate(spec, REPETITIVE[:2], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    stats = engine.make_stats().engine
    text = generate_latest(metrics.registry).decode()
    assert f"jaxserve:spec_decode_num_drafts_total {float(stats.num_spec_drafts)}" in text
    assert f"jaxserve:spec_decode_num_draft_tokens_total {float(stats.num_spec_draft_tokens)}" in text
    assert f"jaxserve:spec_decode_num_accepted_tokens_total {float(stats.num_spec_accepted_tokens)}" in text
    for position, count in enumerate(stats.spec_accepted_per_position):
        assert f'jaxserve:spec_decode_num_accepted_tokens_per_pos_total{{position="{position}"}} {float(count)}' in text
    assert sum(stats.spec_accepted_per_position) == stats.num_spec_accepted_tokens
    line = logger.log(engine.make_stats())
    assert "Draft acceptance rate: " in line and "Mean acceptance length: " in line
