"""The native K/V write (`kernels_cpu.write_kv_rows`, the cpu backend's `write_kv(writes="native")`): the pool it
writes equals XLA's scatter for every pool dtype the CPU stores (float32, bfloat16 and float8 as their bits; int8
with its scales: tests/quantization/test_int8_kv_cache.py), padding tokens are dropped, other layers and slots are
untouched; a step writes the donated pool in place, one custom call per layer and no XLA scatter; bad input is a
clear error."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from jaxserve import LLM
from jaxserve.attention.kv_cache import write_kv
from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_models import make_tiny_model

LAYERS, HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM = 3, 2, 6, 16, 64
LAYER = 1
# (query shape, metadata, tokens written): two rows of 5 query slots, the first 5 tokens from position 14 (across
# its two blocks), the second 1 token and 4 of padding; and a lone decode token
BATCHES = {
    "chunk-and-padding": ((2, 5), AttentionMetadata(jnp.array([[4, 1], [2, 0]], jnp.int32), jnp.array([14, 7]),
                                                    jnp.array([19, 8])), 6),
    "one-token": ((1, 1), AttentionMetadata(jnp.array([[3, 5]], jnp.int32), jnp.array([20]), jnp.array([21])), 1),
}


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert kernels_cpu.load() is not None, kernels_cpu.build_error()


def _random_pool(dtype, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (LAYERS, HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM)
    if dtype == np.float32:
        return rng.normal(size=shape).astype(np.float32)
    return rng.integers(0, np.iinfo(dtype).max, size=shape, endpoint=True).astype(dtype)


def _written(writes: str, k_pool, v_pool, k, v, meta):
    step = jax.jit(lambda kp, vp, k, v: write_kv(kp, vp, jnp.int32(LAYER), k, v, meta, writes=writes),
                   donate_argnums=(0, 1))
    return [np.asarray(pool) for pool in step(jnp.asarray(k_pool), jnp.asarray(v_pool), k, v)]


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("pool_dtype", [np.float32, np.uint16, np.uint8], ids=["float32", "bfloat16-bits", "fp8-bits"])
def test_native_writes_equal_xlas_scatter_and_touch_only_the_tokens_slots(pool_dtype, batch):
    query_shape, meta, num_tokens = BATCHES[batch]
    k_pool, v_pool = _random_pool(pool_dtype, 0), _random_pool(pool_dtype, 1)
    k = jax.random.normal(jax.random.key(2), (*query_shape, HEADS, HEAD_DIM), jnp.float32) * 3
    native = _written("native", k_pool, v_pool, k, -k, meta)
    scattered = _written("rows", k_pool, v_pool, k, -k, meta)
    for new, expected, before in zip(native, scattered, (k_pool, v_pool), strict=True):
        np.testing.assert_array_equal(new, expected)
        changed = np.any(new != before, axis=-1)  # [L, Hkv, blocks, block_size]: rows written
        assert changed.sum() == changed[LAYER].sum() == num_tokens * HEADS


def test_rows_of_another_dtype_than_their_pool_are_refused():
    pool = jnp.zeros((LAYERS, HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM), jnp.uint16)
    rows = jnp.zeros((2, HEADS, HEAD_DIM), jnp.float32)
    with pytest.raises(ValueError, match=r"^K/V rows must have their pool's dtype and the pools one shape: pools "
                                         r"uint16\[3, 2, 6, 16, 64\] and uint16\[3, 2, 6, 16, 64\], rows float32 "
                                         r"and float32$"):
        kernels_cpu.write_kv_rows(pool, pool, 0, rows, rows, jnp.zeros(2, jnp.int32))


def test_a_layer_outside_the_pool_is_an_error_not_a_write():
    pool = jnp.zeros((LAYERS, HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM), jnp.float32)
    rows = jnp.ones((2, HEADS, HEAD_DIM), jnp.float32)
    with pytest.raises(jax.errors.JaxRuntimeError, match="the rows' kv heads or the layer do not fit the pool"):
        jax.block_until_ready(kernels_cpu.write_kv_rows(pool, pool, LAYERS, rows, rows, jnp.zeros(2, jnp.int32)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("kv_write") / "llama", "llama", seed=4, num_hidden_layers=3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"], ids=["unrolled-bfloat16", "scanned-float32"])
def test_steps_write_the_donated_pool_in_place_with_one_custom_call_per_layer(model_dir, tmp_path, dtype):
    """bfloat16 on CPU unrolls the layers (`common.layer_stack`), float32 scans them: either way each step's K/V go
    through one native write per layer (unrolled) or one in the loop body (scanned), XLA compiles no scatter into the
    pool, and its temporary buffers hold less than one pool (no copy of it)."""
    llm = LLM(str(model_dir), dtype=dtype, max_model_len=128, buckets=small_bucket_file(tmp_path),
              attention_backend="cpu")
    runner = llm.llm_engine.runner
    pool_bytes = runner.kv_pool[0].nbytes
    calls_per_step = 3 if dtype == "bfloat16" else 1
    # the pool's element type and leading dimensions in HLO text (flattened in a scatter: [L, Hkv, slots, D])
    element = {"uint16": "u16", "float32": "f32"}[str(runner.kv_pool[0].dtype)]
    pool_prefix = re.escape(f"{element}[{runner.kv_pool[0].shape[0]},{runner.kv_pool[0].shape[1]},")
    assert len(runner.executables) == 3
    for shape, executable in runner.executables.items():
        hlo = executable.as_text()
        assert len(re.findall(r'custom_call_target="jaxserve_kv_write"', hlo)) == calls_per_step, shape
        assert not re.search(rf"= {pool_prefix}[\d,]*\]\S* (scatter|copy)\(", hlo), shape
        assert executable.memory_analysis().temp_size_in_bytes < pool_bytes, shape
