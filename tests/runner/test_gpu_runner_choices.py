"""What a GPU runner does differently, checked on CPU by counting the CPU as a GPU platform: its layers unrolled
(a scan copies every layer's weights on XLA:GPU), and its steps return their rows' argmax, so that a step whose rows
all take it runs no sampler (whose lax.conds XLA:GPU decides on the host, waiting for the step), as the host decides
step by step."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.runner import model_runner
from jaxserve.testing.hf_reference import hf_greedy
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_models import make_tiny_model

PROMPTS = [list(range(5, 45)), [7, 8, 9], list(range(100, 150))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=5)


@pytest.fixture(scope="module")
def gpu_like_llm(model_dir):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner, "GPU_PLATFORMS", ("cpu",))
        llm = LLM(str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=4,
                  buckets=small_bucket_file(model_dir, (4,), chunk=64))
    runner = llm.llm_engine.runner
    runs = []  # the batch size of every sampler run

    def counting(shape, executable):
        return lambda *args: runs.append(shape.batch_size) or executable(*args)

    runner.sampler_executables = {shape: counting(shape, ex) for shape, ex in runner.sampler_executables.items()}
    return llm, runs


def test_layers_unrolled_and_no_more_programs(gpu_like_llm):
    runner = gpu_like_llm[0].llm_engine.runner
    assert runner.argmax_in_step and not runner.model.scan_layers
    assert sorted(name for name in runner.programs(list(runner.executables)) if name.startswith("sample")) == [
        "sample-s1", "sample-s4"]


def test_greedy_steps_run_no_sampler_and_equal_transformers(gpu_like_llm, model_dir):
    llm, runs = gpu_like_llm
    runs.clear()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model_dir, p, 8) for p in PROMPTS]
    assert runs == []
    assert llm.llm_engine.stats.num_compiles_after_warm_up == 0


def test_a_step_with_a_sampled_or_logprobs_row_runs_the_sampler(gpu_like_llm):
    """A greedy request beside a seeded sampled one, and one asking for logprobs: its tokens equal its tokens
    alone (no sampler), each of the 6 steps that sample the other row runs the sampler (a step of the greedy row
    alone, its prefill, runs none)."""
    llm, runs = gpu_like_llm
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    for other in (SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True),
                  SamplingParams(temperature=0.0, logprobs=2, max_tokens=6, ignore_eos=True)):
        runs.clear()
        outputs = llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}],
                               [greedy, other], use_tqdm=False)
        assert outputs[0].outputs[0].token_ids == alone
        assert len(runs) >= 6
    assert outputs[1].outputs[0].logprobs is not None and len(outputs[1].outputs[0].logprobs) == 6


def test_an_unconstrained_steps_bitmask_stays_on_the_device(gpu_like_llm):
    """(Every platform.) A step without constrained rows reads the runner's one device copy of the all-allowed
    bitmask; a constrained row's mask travels with its step."""
    import jax
    import numpy as np

    from jaxserve.runner.sampler import SamplingRow, SamplingTensors, bitmask_words

    runner = gpu_like_llm[0].llm_engine.runner
    vocab, slots = runner.config.vocab_size, runner.num_sampler_slots
    plain = runner._device_sampling(SamplingTensors.from_rows([], 4, slots, vocab))
    assert isinstance(plain.allowed, jax.Array) and np.all(np.asarray(plain.allowed) == -1)
    assert runner._device_sampling(SamplingTensors.from_rows([], 4, slots, vocab)).allowed is plain.allowed
    mask = np.zeros(bitmask_words(vocab), np.int32)
    row = SamplingRow((0.0, 1.0, 0.0, 0.0, 0.0, 1.0), allowed=mask)
    constrained = SamplingTensors.from_rows([row], 4, slots, vocab)
    assert runner._device_sampling(constrained) is constrained
