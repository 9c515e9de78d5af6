"""The runner calls host 0 sends to the other hosts: arrays keep dtype, shape and values (large ones of mostly one
value travel as it and the entries that differ), registered dataclasses come back equal, earlier outputs travel as
their numbers, anything else is refused."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core.buckets import DecodeBucket, MixedBucket
from jaxserve.replication import step_messages
from jaxserve.replication.step_messages import OutputHandles, decode, encode
from jaxserve.runner.input_batch import StepInputs
from jaxserve.runner.model_runner import StepOutput
from jaxserve.runner.sampler import SamplingTensors
from jaxserve.runner.spec_verify import VerifyInputs


def _step_inputs(verify: VerifyInputs | None = None) -> StepInputs:
    rng = np.random.default_rng(0)
    sampling = SamplingTensors(rng.random((4, 6), np.float32), rng.integers(0, 9, (4, 8), np.int32),
                               np.zeros((4, 1536), np.int32))
    return StepInputs(rng.integers(0, 100, (1, 32), np.int32), rng.integers(0, 64, (4, 8), np.int32),
                      np.arange(4, dtype=np.int32), np.array([5, 6, 7, 0], np.int32), np.zeros(4, np.int32), sampling,
                      feed_rows=np.array([0, 1, -1, -1], np.int32), verify=verify)


def _output(tokens) -> StepOutput:
    return StepOutput(tokens=tokens, logits=jnp.zeros((4, 8)), logprobs=None, prompt_logprobs=None)


def _assert_same(got, expected) -> None:
    if isinstance(expected, np.ndarray):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
    elif isinstance(expected, StepInputs | SamplingTensors | VerifyInputs):
        assert type(got) is type(expected)
        for name in expected.__dataclass_fields__:
            _assert_same(getattr(got, name), getattr(expected, name))
    else:
        assert got == expected


def test_a_step_call_comes_back_equal():
    verify = VerifyInputs.from_rows([0, 5], [5, 3], [[], [7, 8]], 8, 4, 2)
    inputs = _step_inputs(verify)
    runner, method, (bucket, got, prev) = decode(encode(["target", "execute", [MixedBucket(32, 4, 128), inputs, None]],
                                                        OutputHandles()), OutputHandles())
    assert (runner, method, bucket, prev) == ("target", "execute", MixedBucket(32, 4, 128), None)
    _assert_same(got, inputs)


def test_arrays_of_mostly_one_value_travel_as_it_and_the_others():
    bias = np.zeros(49152, np.float32)
    bias[[3, 40000]] = [2.5, -1.0]
    mask = np.zeros(49152, bool)
    mask[7] = True
    allow_all = np.full((16, 1536), -1, np.int32)
    allow_all[3, 7] = 5
    dense = np.arange(2048, dtype=np.int32)
    payload = encode(["target", "write_slot", [np.int32(5), bias, mask, allow_all, dense]], OutputHandles())
    assert len(payload) < 2048 * 4 + 300  # the dense array, its header and three sparse ones of a few entries
    _, _, (slot, *arrays) = decode(payload, OutputHandles())
    assert slot == 5 and isinstance(slot, int)
    for got, expected in zip(arrays, (bias, mask, allow_all, dense), strict=True):
        _assert_same(got, expected)


def test_earlier_outputs_travel_as_their_numbers_on_both_sides():
    sent, received = OutputHandles(), OutputHandles()
    first, second = _output(jnp.arange(4)), _output(jnp.arange(4) + 1)
    follower_first, follower_second = _output(jnp.zeros(4)), _output(jnp.ones(4))
    for leader_out, follower_out in ((first, follower_first), (second, follower_second)):
        sent.add(leader_out)
        received.add(follower_out)
    payload = encode(["target", "execute", [DecodeBucket(4, 128), None, first.tokens]], sent)
    assert decode(payload, received)[2][2] is follower_first.tokens
    payload = encode(["target", "resample", [second, None]], sent)
    assert decode(payload, received)[2][0] is follower_second


def test_an_output_too_old_to_name_is_an_error():
    sent, received = OutputHandles(), OutputHandles()
    outputs = [_output(jnp.full(4, i)) for i in range(step_messages.KEPT_OUTPUTS + 1)]
    sent.add(outputs[0])
    payload = encode(["target", "resample", [outputs[0], None]], sent)
    for out in outputs:
        received.add(out)
    with pytest.raises(ValueError, match="names output 0, which this host no longer holds"):
        decode(payload, received)


def test_unregistered_objects_are_refused():
    with pytest.raises(TypeError, match="cannot send a PosixPath to the other hosts"):
        encode(["target", "execute", [Path("x")]], OutputHandles())
