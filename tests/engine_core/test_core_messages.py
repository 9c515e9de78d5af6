"""The engine core's wire format and the client's rebuilding of cumulative outputs from deltas."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest

from jaxserve.engine_core import core_messages as msg
from jaxserve.engine_core.core_process import EngineCore
from jaxserve.engine_core.output_accumulator import CumulativeOutputs
from jaxserve.metrics.stats import EngineStats, SchedulerStats, StatsSnapshot
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams


def test_requests_travel_whole():
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, seed=11, stop=["\n", "END"], logit_bias={7: -2.5},
                            structured_outputs=StructuredOutputsParams(
                                json={"type": "object"}, reasoning_end="</think>", disable_additional_properties=False),
                            output_kind=RequestOutputKind.DELTA, logprobs=3, truncate_prompt_tokens=4,
                            allowed_token_ids=[3, 5], bad_words=["no", "never"])
    beams = BeamSearchParams(beam_width=3, max_tokens=5)
    message = [msg.ADD, "r-1", {"prompt": "hi", "prompt_token_ids": [1, 2]}, params, 3]
    assert msg.decode(msg.encode(message)) == message
    assert msg.decode(msg.encode(beams)) == beams
    decoded = msg.decode(msg.encode(params))
    assert decoded.logit_bias == {7: -2.5} and decoded.output_kind is RequestOutputKind.DELTA


def test_the_core_adds_a_request_with_its_params_and_priority():
    """What `EngineCore._apply` hands the engine of an "add" message, decoded from its bytes."""
    added = []
    core = SimpleNamespace(engine=SimpleNamespace(add_request=lambda *args: added.append(args)), running=True)
    params = SamplingParams(bad_words=["no"], allowed_token_ids=[3], truncate_prompt_tokens=2)
    prompt = {"prompt": "hi", "prompt_token_ids": [1, 2]}
    EngineCore._apply(core, [msg.decode(msg.encode([msg.ADD, "r-1", prompt, params, -4]))])
    ((request_id, received_prompt, received, priority),) = added
    assert (request_id, received_prompt, priority) == ("r-1", prompt, -4)
    assert (received.bad_words, received.allowed_token_ids, received.truncate_prompt_tokens) == (["no"], [3], 2)


def test_outputs_travel_whole_with_numpy_values():
    logprobs = [{5: Logprob(np.float32(-0.25), 1, "a"), 9: Logprob(-1.5, 2, "b")}]
    output = RequestOutput("r", None, [], [CompletionOutput(0, "a", [5], -0.25, logprobs, "stop", "a")], True,
                           prompt_logprobs=[None, {3: Logprob(-2.0, 4, "c")}], num_cached_tokens=16)
    stats = StatsSnapshot(SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5), EngineStats(num_steps=9))
    message = msg.decode(msg.encode([msg.OUTPUTS, [["r", output]], [["s", "ValueError", "bad"]], stats, 4]))
    assert message == [msg.OUTPUTS, [["r", output]], [["s", "ValueError", "bad"]], stats, 4]
    assert type(message[1][0][1].outputs[0].logprobs[0][5].logprob) is float


def test_only_known_classes_travel():
    @dataclasses.dataclass
    class Stranger:
        x: int = 1

    with pytest.raises(TypeError, match="cannot send a Stranger to or from the engine core"):
        msg.encode([Stranger()])
    forged = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["Popen", [["rm", "-rf", "/"]]])))
    with pytest.raises(ValueError, match="unknown object in an engine core message: 'Popen'"):
        msg.decode(forged)


def _delta(index: int, text: str, tokens: list[int], finish: str | None = None, logprobs=None) -> CompletionOutput:
    return CompletionOutput(index, text, tokens, -1.0 * len(tokens), logprobs, finish, None)


def test_deltas_add_up_to_cumulative_outputs():
    acc = CumulativeOutputs("p", [1, 2])
    ab = _delta(0, "ab", [3, 4], logprobs=[{3: Logprob(-1)}, {4: Logprob(-2)}])
    first = acc.add(RequestOutput("r", None, [], [ab], False, prompt_logprobs=[None, {2: Logprob(-3)}]))
    c = _delta(0, "c", [5], logprobs=[{5: Logprob(-4)}])
    second = acc.add(RequestOutput("r", None, [], [_delta(1, "x", [7]), c], False))
    last = acc.add(RequestOutput("r", None, [], [_delta(1, "", [], "length")], True))
    assert (first.prompt, first.prompt_token_ids) == ("p", [1, 2])
    assert [(c.index, c.text, c.token_ids) for c in first.outputs] == [(0, "ab", [3, 4])]
    assert [(c.index, c.text, c.token_ids) for c in second.outputs] == [(0, "abc", [3, 4, 5]), (1, "x", [7])]
    assert [len(c.logprobs or []) for c in second.outputs] == [3, 0]
    assert second.prompt_logprobs == [None, {2: Logprob(-3)}]
    assert [c.finish_reason for c in last.outputs] == [None, "length"] and last.finished
    assert first.outputs[0].token_ids == [3, 4]  # an output handed out earlier is never changed later
