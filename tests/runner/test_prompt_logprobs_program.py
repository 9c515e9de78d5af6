"""The prompt logprobs' own program (`runner/logprobs.py`): steps of several query tokens leave their hidden states
and targets in the donated `PromptPositions` and compute no logprobs; "prompt-logprobs" computes them, once per
engine rather than in every prefill and mixed step. Its values are checked against transformers in
tests/engine/test_generation.py."""

from __future__ import annotations

import re

import numpy as np
import pytest

from jaxserve.compilation.precompile import abstract_params
from jaxserve.runner.input_batch import StepShape
from jaxserve.runner.model_runner import PROMPT_LOGPROBS, ModelRunner, executable_name
from jaxserve.runner.sampler import FLAG_PROMPT_LOGPROBS, SamplingRow, SamplingTensors
from jaxserve.testing.tiny_models import tiny_hf_config
from jaxserve.weights import load_config

PREFILL = StepShape(2, 16, 2)  # 2 rows of 16 query tokens: 32 positions
DECODE = StepShape(4, 1, 2)


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    config = tiny_hf_config("llama")
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    return load_config(path)


def abstract_runner(model_config, max_step_tokens: int) -> ModelRunner:
    return ModelRunner(model_config, abstract_params(model_config, "float32"), dtype="float32", block_size=16,
                       num_blocks=8, max_rows=4, abstract=True, num_sampler_slots=4, num_logprobs=3,
                       max_step_tokens=max_step_tokens)


def test_steps_leave_their_positions_and_only_the_prompt_logprobs_program_ranks_the_vocabulary(model_config):
    runner = abstract_runner(model_config, max_step_tokens=40)
    positions = runner.prompt_positions
    assert positions.hidden.shape == (64, model_config.output_hidden_size)  # 40 rounded up to whole chunks of 32
    assert positions.targets.shape == (64,)
    programs = runner.programs([PREFILL, DECODE])
    lowered = {name: jitted.lower(*args).as_text() for name, (jitted, args) in programs.items()
               if name in (executable_name(PREFILL), executable_name(DECODE), PROMPT_LOGPROBS)}
    assert ["top_k" in text for text in lowered.values()] == [False, False, True]
    for name in (executable_name(PREFILL), executable_name(DECODE)):  # both donate the positions: kept in place
        for arg in (f"tensor<64x{model_config.output_hidden_size}xf32>", "tensor<64xi32>"):
            assert re.search(arg + r" \{sdy.sharding = [^>]*>, tf.aliasing_output = \d+", lowered[name]), (name, arg)


def test_a_runner_without_positions_has_no_prompt_logprobs_program_and_says_so_when_asked(model_config):
    runner = abstract_runner(model_config, max_step_tokens=0)  # a draft model's
    assert runner.prompt_positions is None
    assert PROMPT_LOGPROBS not in runner.programs([PREFILL])
    row = SamplingRow((0.0, 1.0, 0.0, 0.0, 0.0, 1.0), flags=FLAG_PROMPT_LOGPROBS)
    sampling = SamplingTensors.from_rows([row], 2, 4, model_config.vocab_size)
    assert runner._run_prompt_logprobs(DECODE, sampling) is None  # a decode step has no prompt positions
    with pytest.raises(ValueError, match=r"this runner computes no prompt logprobs \(max_step_tokens=0\)"):
        runner._run_prompt_logprobs(PREFILL, sampling)
    no_row_asks = SamplingTensors.from_rows([SamplingRow((0.0, 1.0, 0.0, 0.0, 0.0, 1.0))], 2, 4,
                                            model_config.vocab_size)
    assert runner._run_prompt_logprobs(PREFILL, no_row_asks) is None
    assert np.all(no_row_asks.flags == 0)
