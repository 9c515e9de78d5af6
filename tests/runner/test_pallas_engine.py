"""The engine with the Pallas attention backend (interpret mode on CPU) gives the reference backend's tokens, on
prefill, decode and mixed steps (the ragged kernel)."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_models import TINY_64, make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny64"), "llama", seed=3, **TINY_64)


def _run(model_dir, backend: str) -> list[list[int]]:
    # one bucket of each step kind (the interpreted kernels compile slowly): prefill chunks of 64, decode 4
    # rows, mixed steps of 4 rows and 64 tokens, context 512
    buckets = small_bucket_file(model_dir, (4,), mixed=True, chunk=64, context=512)
    llm = LLM(
        str(model_dir), dtype="float32", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=128,
        attention_backend=backend, buckets=buckets,
    )
    runner = llm.llm_engine.runner
    assert runner.backend.name == backend
    # the TPU kernels' lane-dense pool: two 64-wide tokens per 128-lane row (pages of 16 tokens in 8 rows)
    assert runner.kv_pool[0].shape[-2:] == ((8, 128) if backend == "pallas" else (16, 64))
    prompts = [
        {"prompt_token_ids": list(range(5, 45))},  # spans pages of 16
        {"prompt_token_ids": [7, 8, 9]},
        {"prompt_token_ids": list(range(100, 300))},  # a long prompt: prefilled in chunks
    ]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = llm.llm_engine.stats
    assert stats.num_prefill_steps and stats.num_decode_steps and stats.num_mixed_steps  # every step kind ran
    return tokens


def test_pallas_backend_matches_reference_tokens(model_dir):
    reference = _run(model_dir, "reference")
    assert _run(model_dir, "pallas") == reference
