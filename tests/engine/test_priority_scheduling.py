"""The priority scheduling policy end to end (vLLM's `--scheduling-policy priority`): an engine that runs one
sequence at a time serves its requests in priority order, then arrival; beam searches take their priority too.
The policy's queue and preemption order are unit-tested in `tests/core/test_scheduler.py`."""

from __future__ import annotations

import pytest

from jaxserve import SamplingParams
from jaxserve.sampling_params import BeamSearchParams
from tests.generation_fixtures import BUCKETS, llm_on_buckets, tokens_prompt

PROMPT = list(range(5, 21))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from jaxserve.testing.tiny_models import make_tiny_model

    tmp = tmp_path_factory.mktemp("priority")
    model_dir = make_tiny_model(tmp / "model", "llama", seed=1)
    return llm_on_buckets(model_dir, tmp, "buckets", BUCKETS, max_num_seqs=1, scheduling_policy="priority")


def finish_order(engine) -> list[str]:
    order = []
    while engine.has_unfinished_requests():
        order += [out.request_id for out in engine.step() if out.finished]
    return order


def test_requests_are_served_lowest_priority_value_first_then_by_arrival(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for request_id, priority in [("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", -1)]:
        engine.add_request(request_id, tokens_prompt(PROMPT), params, priority=priority)
    assert finish_order(engine) == ["e", "b", "d", "c", "a"]


def test_llm_generate_takes_one_priority_per_prompt(llm):
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outputs = llm.generate([tokens_prompt(PROMPT)] * 2, params, use_tqdm=False, priority=[1, 0])
    assert [len(out.outputs[0].token_ids) for out in outputs] == [2, 2]
    with pytest.raises(ValueError, match=r"^The lengths of prompts \(2\) and priority \(1\) must be the same\.$"):
        llm.generate([tokens_prompt(PROMPT)] * 2, params, use_tqdm=False, priority=[1])


def test_a_beam_search_takes_its_priority(llm):
    engine = llm.llm_engine
    engine.add_request("sampled", tokens_prompt(PROMPT), SamplingParams(temperature=0.0, max_tokens=2), priority=1)
    engine.add_request("beams", tokens_prompt(PROMPT), BeamSearchParams(beam_width=1, max_tokens=2), priority=0)
    assert [seq.priority for seq in engine.requests["beams"].seqs] == [0]
    assert finish_order(engine) == ["beams", "sampled"]
