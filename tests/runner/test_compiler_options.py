"""The XLA options of the runner's programs (`runner/compiler_options.py`): float32 programs on CPU compile with
XLA:CPU's LLVM IR emitters, bfloat16 steps with its fusion emitters, other platforms with XLA's defaults."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxserve.compilation.precompile import abstract_params
from jaxserve.runner.compiler_options import FUSION_EMITTERS, GPU_OPTIONS, LLVM_IR_EMITTERS, compiler_options
from jaxserve.runner.input_batch import SampleShape, StepShape
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.testing.tiny_models import tiny_hf_config
from jaxserve.weights import load_config


@pytest.mark.parametrize(
    ("platform", "dtype", "expected"),
    [("cpu", jnp.float32, LLVM_IR_EMITTERS), ("cpu", jnp.bfloat16, FUSION_EMITTERS), ("tpu", jnp.float32, None),
     ("cuda", jnp.float32, GPU_OPTIONS), ("gpu", jnp.bfloat16, GPU_OPTIONS), ("cpu", "float32", LLVM_IR_EMITTERS)],
)
def test_only_float32_programs_on_cpu_get_the_llvm_ir_emitters(platform, dtype, expected):
    assert compiler_options(platform, dtype) == expected


@pytest.mark.parametrize(("dtype", "step_options"), [("float32", LLVM_IR_EMITTERS), ("bfloat16", FUSION_EMITTERS)])
def test_the_runner_compiles_its_steps_in_their_dtype_and_its_sampler_in_float32(tmp_path, monkeypatch, dtype,
                                                                                   step_options):
    config = tiny_hf_config("llama")
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    model_config = load_config(tmp_path)
    runner = ModelRunner(model_config, abstract_params(model_config, dtype), dtype=dtype, block_size=16,
                         num_blocks=8, max_rows=4, abstract=True, num_sampler_slots=4, num_logprobs=2)
    seen = []
    original = jax.stages.Lowered.compile
    monkeypatch.setattr(jax.stages.Lowered, "compile",
                        lambda self, options=None: seen.append(options) or original(self, options))
    runner.compile(StepShape(4, 1, 2))
    runner.compile_sampler(SampleShape(4))
    assert seen == [step_options, LLVM_IR_EMITTERS]
    assert runner.compiler_options_of("step-s4-q1-p2") == step_options  # what bench_compile.py compiles with
    assert runner.compiler_options_of("prompt-logprobs") == step_options  # the lm head, in the engine's dtype
    assert runner.compiler_options_of("sample-s4") == runner.compiler_options_of("copy_blocks") == LLVM_IR_EMITTERS
