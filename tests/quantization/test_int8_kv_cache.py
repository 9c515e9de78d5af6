"""The int8 KV cache (`kv_cache_dtype="int8"`, vLLM's `int8_per_token_head`): each token's K and V row of each kv
head stored as int8 with a float32 scale (max |x| / 127) beside the pages, read back as values x scale. On a tiny
random Llama in float32, the native CPU kernel's and the Pallas kernels' greedy tokens equal transformers' generate
with a cache that quantizes K/V the same way (the Pallas kernels interpreted: prefill, decode and mixed steps); the
writes put each scale at its token's slot in either page layout, and the reference backend's gather reads it back;
a fork copies scales with pages; a memory budget holds 2 D / (D + 4) times bfloat16's blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxserve import LLM, SamplingParams
from jaxserve.attention.kv_cache import ScaledPages, gather_context, kv_value_dtype, quantize_rows, write_kv
from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.compilation.sizing import kv_bytes_per_block
from jaxserve.runner.model_runner import copy_pool_blocks
from jaxserve.testing.hf_reference import greedy_continuation
from jaxserve.testing.rounding_caches import Int8RoundingCache
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_models import TINY_64, make_tiny_model

PROMPTS = [[5, 77, 140, 9, 33, 201, 18, 64, 7, 120, 99, 3, 250, 41, 17, 8, 66, 90, 12, 200], [250, 3, 41]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=5, **TINY_64)


@pytest.fixture(scope="module")
def expected(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [greedy_continuation(model, p, MAX_TOKENS, Int8RoundingCache(config=model.config)) for p in PROMPTS]


@pytest.mark.parametrize("backend", ["cpu", "pallas"])  # the reference backend's gather: the write test below
def test_int8_kv_cache_tokens_equal_transformers_with_a_quantizing_cache(model_dir, tmp_path, expected, backend):
    # prefill chunks of 16 (the 20-token prompt takes two, the second a mixed step beside the other's decode)
    buckets = small_bucket_file(tmp_path, decode_batch_sizes=(2,), mixed=True, chunk=16, context=64)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=64, buckets=buckets, kv_cache_dtype="int8",
              attention_backend=backend, max_num_batched_tokens=16)
    k_pool, v_pool = llm.llm_engine.runner.kv_pool
    assert isinstance(k_pool, ScaledPages) and k_pool.values.dtype == v_pool.values.dtype == jnp.int8
    assert k_pool.scales.shape == (*k_pool.values.shape[:3], 16) and k_pool.scales.dtype == jnp.float32
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.llm_engine.stats.num_mixed_steps > 0
    k_pool = llm.llm_engine.runner.kv_pool[0]
    written = sum(len(p) + MAX_TOKENS - 1 for p in PROMPTS)  # every token but the last sampled has its K/V stored
    layers_and_heads = k_pool.scales.shape[0] * k_pool.scales.shape[1]
    assert int(jnp.count_nonzero(k_pool.scales)) == written * layers_and_heads


def test_the_int8_cache_is_not_the_float32_one(model_dir, expected):
    """The quantization matters on this model: without it transformers' tokens differ (else the test above could
    not tell an int8 pool from a float32 one)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert [greedy_continuation(model, p, MAX_TOKENS) for p in PROMPTS] != expected


def test_rows_are_quantized_to_their_own_max():
    x = jnp.array([[[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [-254.0, 127.0, 1.0, 0.6]]], jnp.float32)
    values, scales = quantize_rows(x)
    assert values.dtype == jnp.int8 and scales.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(scales), np.float32([[1 / 127, 0.0, 2.0]]))
    # 0.5 * 127 = 63.5 and 0.25 * 127 = 31.75 round to even / nearest; 1 / 2 and 0.6 / 2 round to 0
    np.testing.assert_array_equal(np.asarray(values), [[[127, -64, 32, 0], [0, 0, 0, 0], [-127, 64, 0, 0]]])


def _int8_pool(layers, heads, blocks, block_size, head_dim, tokens_per_row=1):
    rows, lanes = block_size // tokens_per_row, head_dim * tokens_per_row
    pages = jnp.zeros((layers, heads, blocks, rows, lanes), jnp.int8)
    return ScaledPages(pages, jnp.zeros((layers, heads, blocks, block_size), jnp.float32))


@pytest.mark.parametrize("tokens_per_row, writes",
                         [(1, "rows"), (1, "head_windows"), (2, "head_windows"), (1, "native")])
def test_writes_put_each_scale_at_its_token_s_slot(tokens_per_row, writes):
    """Two sequences, one of 5 new tokens from position 14 (crossing into its second block), one of 1: read back
    through the block tables, every written row is its quantized value times its scale, nothing else is touched."""
    layers, heads, blocks, block_size, head_dim = 2, 2, 6, 16, 64
    pool = _int8_pool(layers, heads, blocks, block_size, head_dim, tokens_per_row)
    k = jax.random.normal(jax.random.key(0), (2, 5, heads, head_dim), jnp.float32) * 3
    meta = AttentionMetadata(block_tables=jnp.array([[4, 1], [2, 0]], jnp.int32), q_start=jnp.array([14, 7]),
                             lengths=jnp.array([19, 8]))
    k_pool, v_pool = write_kv(pool, pool, jnp.int32(1), k, -k, meta, writes=writes)
    if tokens_per_row > 1:  # read the lane-dense pages in the plain layout
        plain = lambda p: ScaledPages(p.values.reshape(layers, heads, blocks, block_size, head_dim), p.scales)
        k_pool, v_pool = plain(k_pool), plain(v_pool)
    values, scales = quantize_rows(k)
    rebuilt = values.astype(jnp.float32) * scales[..., None]  # [S, Q, Hkv, D]
    read = gather_context(k_pool, jnp.int32(1), meta.block_tables)  # [S, Hkv, 32, D]
    np.testing.assert_array_equal(np.asarray(read[0, :, 14:19]), np.asarray(rebuilt[0].transpose(1, 0, 2)))
    np.testing.assert_array_equal(np.asarray(read[1, :, 7]), np.asarray(rebuilt[1, 0]))
    np.testing.assert_array_equal(np.asarray(gather_context(v_pool, jnp.int32(1), meta.block_tables)[1, :, 7]),
                                  -np.asarray(rebuilt[1, 0]))
    assert int(jnp.count_nonzero(k_pool.scales)) == heads * 6 and not jnp.any(k_pool.scales[0])
    assert int(jnp.count_nonzero(k_pool.scales[1, :, 4, 14:])) == heads * 2


def test_a_fork_copies_scales_with_pages():
    pool = _int8_pool(1, 1, 4, 16, 64)
    pool = ScaledPages(pool.values.at[0, 0, 1].set(5), pool.scales.at[0, 0, 1].set(0.25))
    k_pool, _ = copy_pool_blocks((pool, pool), jnp.array([1]), jnp.array([3]), (4,))
    assert jnp.all(k_pool.values[0, 0, 3] == 5) and jnp.all(k_pool.scales[0, 0, 3] == 0.25)


def test_a_block_counts_its_scales():
    assert kv_value_dtype("int8", "bfloat16") == kv_value_dtype("int8_per_token_head", "float32") == jnp.int8
    bf16 = kv_bytes_per_block(num_layers=30, num_kv_heads=3, block_size=16, head_dim=64, dtype_bytes=2)
    int8 = kv_bytes_per_block(num_layers=30, num_kv_heads=3, block_size=16, head_dim=64, dtype_bytes=1,
                              scale_bytes=4)
    assert (bf16, int8) == (2 * 30 * 3 * 16 * 128, 2 * 30 * 3 * 16 * 68)
