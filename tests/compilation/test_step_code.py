"""The compile cache's step-code hash covers every file traced into a step: lowering every program of each
model family on each attention backend (while a profiler records which files' functions run) touches only
files of `compile_cache.STEP_CODE`, besides two that run during lowering without shaping any program. A
change to any of them changes the manifest's hash, so a stale executable is never reused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from jaxserve.compilation import compile_cache
from jaxserve.compilation.compile_cache import step_code_files, step_code_hash
from jaxserve.compilation.precompile import abstract_params
from jaxserve.quantization.weights import apply_quantization
from jaxserve.runner.input_batch import StepShape
from jaxserve.runner.model_runner import PROMPT_LOGPROBS, STEP_PREFIX, ModelRunner
from jaxserve.testing.tiny_models import tiny_hf_config
from jaxserve.weights import load_config
from tests.paths import REPO_ROOT

# Files whose functions run while a step is lowered but do not decide the program.
NOT_PROGRAM_CODE = {
    "jaxserve/compilation/compile_cache.py",  # its jax.monitoring listeners count compile events
    "jaxserve/user_cache.py",  # the directory the CPU kernel's shared library is built in
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "opt": "OPTForCausalLM", "gpt2": "GPT2LMHeadModel"}
# the Pallas kernels take head_dim 64 and pages of 16 tokens; bfloat16 on CPU takes the unstacked-layers path
BACKENDS = (("reference", "float32"), ("cpu", "bfloat16"), ("pallas", "float32"))
SHAPES = (StepShape(2, 8, 2), StepShape(4, 1, 2), StepShape(4, 8, 2, ragged=True))  # prefill, decode, mixed


def _model_config(family: str, directory: Path):
    width = {"n_embd": 256} if family == "gpt2" else {"hidden_size": 256}
    config = tiny_hf_config(family, **width)
    config.architectures = [ARCHITECTURES[family]]
    config.save_pretrained(directory)
    return load_config(directory)


def _files_run_while_lowering(model_config, backend: str, dtype: str, quantization: str | None = None, *,
                              model_programs_only: bool = False) -> set[str]:
    """Repository files (relative paths) whose functions run while the runner is built and every program of
    ``SHAPES`` (steps, samplers, allocations, forks, the prompt logprobs') is traced and lowered; with
    ``model_programs_only`` the steps and the prompt logprobs' (the others run no model code: one family's
    cover them)."""
    files: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            files.add(frame.f_code.co_filename)

    model_config, params = apply_quantization(model_config, abstract_params(model_config, dtype), quantization)
    sys.setprofile(profile)
    try:
        runner = ModelRunner(model_config, params, dtype=dtype, block_size=16, num_blocks=8, max_rows=4,
                             attention_backend=backend, abstract=True, num_sampler_slots=4, num_logprobs=2,
                             max_step_tokens=16)
        for name, (jitted, args) in runner.programs(SHAPES).items():
            if not model_programs_only or name.startswith(STEP_PREFIX) or name == PROMPT_LOGPROBS:
                jitted.trace(*args).lower()
    finally:
        sys.setprofile(None)
    ours = [Path(f).resolve() for f in files if Path(f).is_absolute()]
    return {f.relative_to(REPO_ROOT).as_posix() for f in ours if f.is_relative_to(REPO_ROOT) and ".venv" not in f.parts}


@pytest.fixture(scope="module")
def traced_files(tmp_path_factory) -> set[str]:
    traced = set()
    for family in ARCHITECTURES:
        model_config = _model_config(family, tmp_path_factory.mktemp(family))
        for backend, dtype in BACKENDS:
            traced |= _files_run_while_lowering(model_config, backend, dtype, model_programs_only=bool(traced))
    # quantized weights and activations: the quantized products are traced into the steps too
    llama = _model_config("llama", tmp_path_factory.mktemp("llama-int8"))
    traced |= _files_run_while_lowering(llama, "reference", "float32", quantization="int8_w8a8",
                                        model_programs_only=True)
    return traced


def test_every_file_a_step_traces_is_in_the_step_code_hash(traced_files):
    covered = {file.relative_to(REPO_ROOT).as_posix() for file in step_code_files()}
    # the profile saw the steps' code: the runner, the sampler, the model, the pool writes and all three kernels
    assert {"jaxserve/runner/model_runner.py", "jaxserve/runner/sampler.py", "jaxserve/models/llama.py",
            "jaxserve/models/opt.py", "jaxserve/attention/kv_cache.py", "kernels_pallas/ragged_paged_attention.py",
            "kernels_cpu/__init__.py", "jaxserve/distributed/sharding.py"} <= traced_files
    assert traced_files - NOT_PROGRAM_CODE <= covered, sorted(traced_files - NOT_PROGRAM_CODE - covered)


def test_the_step_code_is_the_traced_folders_whole():
    relative = [file.relative_to(REPO_ROOT).as_posix() for file in step_code_files()]
    assert "jaxserve/runner/sampler.py" in relative and "jaxserve/models/gpt2.py" in relative
    assert "kernels_cpu/paged_attention.cc" in relative  # the native kernel's C++ source too
    assert not [f for f in relative if f.startswith(("jaxserve/engine/", "jaxserve/core/", "jaxserve/entrypoints/"))]
    for entry in compile_cache.STEP_CODE:  # every entry names files that exist
        assert any(f == entry or f.startswith(entry + "/") for f in relative), entry


def test_a_change_to_any_step_code_file_changes_the_hash(monkeypatch):
    before = step_code_hash()
    original = Path.read_bytes
    target = REPO_ROOT / "jaxserve/runner/sampler.py"
    monkeypatch.setattr(Path, "read_bytes", lambda self: original(self) + (b"#" if self == target else b""))
    assert step_code_hash() != before
