"""The float8 KV cache (`kv_cache_dtype="fp8"`): K/V saturated to +-448 and rounded to e4m3 as they are written,
widened as they are read. On a tiny random Llama in float32, every attention backend's greedy tokens equal
transformers' generate with a cache that rounds K/V the same way (the Pallas kernels interpreted: prefill, decode
and mixed steps); the pool stores one byte per value, so a memory budget holds twice bfloat16's blocks. A
checkpoint's calibrated K/V scales (compressed-tensors' kv_cache_scheme) store K / k_scale and V / v_scale."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

from jaxserve import LLM, SamplingParams
from jaxserve.attention.kv_cache import kv_storage_dtype, kv_value_dtype, pool_values, to_pool_dtype
from jaxserve.config.engine_config import EngineConfig
from jaxserve.testing.hf_reference import greedy_continuation
from jaxserve.testing.rounding_caches import KV_SCALES, Fp8RoundingCache, ScaledFp8RoundingCache
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_models import TINY_64, make_tiny_model
from jaxserve.weights import load_model
from jaxserve.weights.compressed_tensors import write_kv_cache_scales

PROMPTS = [[5, 77, 140, 9, 33, 201, 18, 64, 7, 120, 99, 3, 250, 41, 17, 8, 66, 90, 12, 200], [250, 3, 41]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=5, **TINY_64)


@pytest.fixture(scope="module")
def expected(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [greedy_continuation(model, p, MAX_TOKENS, Fp8RoundingCache(config=model.config)) for p in PROMPTS]


@pytest.mark.parametrize("backend", ["reference", "cpu", "pallas"])
def test_fp8_kv_cache_tokens_equal_transformers_with_a_rounding_cache(model_dir, tmp_path, expected, backend):
    # prefill chunks of 16 (the 20-token prompt takes two, the second a mixed step beside the other's decode)
    buckets = small_bucket_file(tmp_path, decode_batch_sizes=(2,), mixed=True, chunk=16, context=64)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=64, buckets=buckets, kv_cache_dtype="fp8",
              attention_backend=backend, max_num_batched_tokens=16)
    runner = llm.llm_engine.runner
    assert runner.kv_pool[0].dtype == jnp.uint8  # float8 bits on XLA:CPU (an in-place integer scatter)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.llm_engine.stats.num_mixed_steps > 0


def test_the_float8_cache_is_not_the_float32_one(model_dir, expected):
    """The rounding matters on this model: without it transformers' tokens differ (else the test above could not
    tell a float8 pool from a float32 one)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert [greedy_continuation(model, p, MAX_TOKENS) for p in PROMPTS] != expected


def test_a_checkpoint_s_kv_scales_store_k_and_v_divided_by_them(model_dir, tmp_path, expected):
    scaled = write_kv_cache_scales(Path(shutil.copytree(model_dir, tmp_path / "scaled")), KV_SCALES)
    config = load_model(str(scaled), "float32").config
    assert config.kv_cache_scales and config.quantization is None
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference = [greedy_continuation(model, p, MAX_TOKENS, ScaledFp8RoundingCache(config=model.config))
                 for p in PROMPTS]
    assert reference != expected  # the scales matter on this model
    buckets = small_bucket_file(tmp_path, decode_batch_sizes=(2,), mixed=True, chunk=16, context=64)
    llm = LLM(str(scaled), dtype="float32", max_model_len=64, buckets=buckets, kv_cache_dtype="fp8",
              max_num_batched_tokens=16)
    layers = llm.llm_engine.runner.params["params"]["layers"]["self_attn"]
    np.testing.assert_array_equal(np.asarray(layers["k_scale"]), np.float32([0.004, 0.003]))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference


def test_other_kv_cache_schemes_are_refused(model_dir, tmp_path):
    scaled = write_kv_cache_scales(Path(shutil.copytree(model_dir, tmp_path / "scaled")), KV_SCALES)
    config = json.loads((scaled / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"]["strategy"] = "channel"
    (scaled / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^unsupported compressed-tensors kv_cache_scheme \(strategy='channel'\); "
                                         r"jaxserve reads float8 K/V scales per tensor"):
        load_model(str(scaled), "float32")


def test_values_are_saturated_and_rounded_to_e4m3_as_stored():
    values = jnp.array([500.0, -1000.0, 448.0, 0.1, -0.3, 1e-9, 17.0], jnp.float32)
    for pool_dtype in (jnp.uint8, jnp.float8_e4m3fn):
        stored = to_pool_dtype(values, jnp.dtype(pool_dtype))
        assert stored.dtype == pool_dtype
        read = np.asarray(pool_values(stored).astype(jnp.float32))
        np.testing.assert_array_equal(read, [448.0, -448.0, 448.0, 0.1015625, -0.3125, 0.0, 16.0])
    assert np.asarray(to_pool_dtype(values[:1], jnp.dtype(jnp.uint8)))[0] == ml_dtypes.float8_e4m3fn(448.0).view(
        np.uint8)


def test_the_pool_dtype_per_platform():
    fp8 = kv_value_dtype("fp8", "bfloat16")
    assert fp8 == kv_value_dtype("fp8_e4m3", "float32") == jnp.float8_e4m3fn
    assert kv_value_dtype("auto", "bfloat16") == jnp.bfloat16
    assert kv_storage_dtype(fp8, "cpu") == jnp.uint8
    assert kv_storage_dtype(fp8, "tpu") == kv_storage_dtype(fp8, "cuda") == jnp.float8_e4m3fn


def test_unknown_kv_cache_dtypes_are_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"^unsupported kv_cache_dtype 'int4'; supported: auto, fp8, fp8_e4m3, int8, "
                                         r"int8_per_token_head$"):
        EngineConfig(kv_cache_dtype="int4")
