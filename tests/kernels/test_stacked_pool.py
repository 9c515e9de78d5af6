"""The kernels on the engine's stacked pool `[layers, kv heads, pages, rows, lanes]` read at a layer index, in
the plain layout (both Pallas variants) and the TPU variant's lane-dense layout (two 64-wide tokens per
128-lane row): each gives what the same kernel gives on that layer's pages alone, while every other layer
is NaN (a kernel that reads outside its layer returns NaN). Interpret mode on CPU; the input checks.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import (
    paged_attention,
    prefill_attention,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from kernels_pallas._common import lane_dense_tokens_per_row
from tests.kernels.conftest import STACK_LAYER as LAYER
from tests.kernels.conftest import STACK_LAYERS as NUM_LAYERS
from tests.kernels.conftest import pool_at_layer
from tests.kernels.test_ragged_paged_attention import ROWS, ragged_batch

HEAD_DIM = 64
SM_SCALE = HEAD_DIM**-0.5


def stacked(pages: np.ndarray, *, lane_dense: bool) -> jnp.ndarray:
    """One layer's pages [Hkv, P, page, D] as layer LAYER of a NaN pool of NUM_LAYERS layers (float32)."""
    return pool_at_layer(jnp.asarray(pages, jnp.float32), "lane-dense" if lane_dense else "stacked")[0]


LAYOUTS = [("tpu", False), ("tpu", True), ("gpu", False)]


def _batch(rows, dtype):
    rng = np.random.default_rng(7)
    q, k, v, tables, row_arrays = ragged_batch(rng, rows, 6, 2, dtype)
    k, v = (np.nan_to_num(x) for x in (k, v))  # the layer itself holds numbers everywhere
    return q, k, v, tables, row_arrays


@pytest.mark.parametrize("backend,lane_dense", LAYOUTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_kernel_reads_its_layer_of_the_stacked_pool(backend, lane_dense, dtype):
    q, k, v, tables, row_arrays = _batch(ROWS[:10], dtype)
    args = [jnp.asarray(x) for x in (tables, *row_arrays)]
    one_layer = ragged_paged_attention(
        jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), *args,
        sm_scale=SM_SCALE, interpret=True, backend=backend,
    )
    out = ragged_paged_attention(
        jnp.asarray(q, dtype), stacked(k, lane_dense=lane_dense).astype(dtype),
        stacked(v, lane_dense=lane_dense).astype(dtype), *args,
        layer=jnp.int32(LAYER), sm_scale=SM_SCALE, interpret=True, backend=backend,
    )
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert not np.isnan(np.asarray(out, np.float32)).any()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(one_layer, np.float32), rtol=tol, atol=tol)
    reference = ragged_paged_attention_reference(
        jnp.asarray(q, dtype), stacked(k, lane_dense=lane_dense).astype(dtype),
        stacked(v, lane_dense=lane_dense).astype(dtype), *args, layer=jnp.int32(LAYER), sm_scale=SM_SCALE,
    )
    np.testing.assert_allclose(np.asarray(reference, np.float32), np.asarray(out, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("backend,lane_dense", LAYOUTS)
def test_decode_and_prefill_kernels_read_their_layer_of_the_stacked_pool(backend, lane_dense):
    q, k, v, tables, (_, _, positions, lengths) = _batch([(1, 40, 41), (1, 15, 16), (1, 0, 1), (1, 46, 47)],
                                                         jnp.float32)
    k_pool, v_pool = stacked(k, lane_dense=lane_dense), stacked(v, lane_dense=lane_dense)
    tables, lengths = jnp.asarray(tables), jnp.asarray(lengths)
    q_decode = jnp.asarray(q[:4])
    kw = dict(interpret=True, backend=backend)
    one_layer = paged_attention(q_decode, jnp.asarray(k), jnp.asarray(v), lengths, tables, **kw)
    out = paged_attention(q_decode, k_pool, v_pool, lengths, tables, layer=jnp.int32(LAYER), **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(one_layer), rtol=1e-5, atol=1e-5)

    q_chunk = jnp.asarray(np.resize(q, (4, 16, *q.shape[1:])))  # 16-token chunks ending at each length
    q_start = jnp.maximum(lengths - 16, 0)
    one_layer = prefill_attention(q_chunk, jnp.asarray(k), jnp.asarray(v), tables, q_start, lengths, **kw)
    out = prefill_attention(q_chunk, k_pool, v_pool, tables, q_start, lengths, layer=jnp.int32(LAYER), **kw)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_allclose(np.asarray(out), np.asarray(one_layer), rtol=1e-5, atol=1e-5)


def test_lane_dense_rows():
    assert lane_dense_tokens_per_row(16, 64) == 2
    assert lane_dense_tokens_per_row(64, 64) == 2
    assert lane_dense_tokens_per_row(16, 128) == 1
    assert lane_dense_tokens_per_row(16, 256) == 1


def test_stacked_pool_input_checks():
    q, k, v, tables, (_, _, _, lengths) = _batch([(1, 40, 41), (1, 15, 16)], jnp.float32)
    q, tables, lengths = jnp.asarray(q[:2]), jnp.asarray(tables), jnp.asarray(lengths)
    dense = stacked(k, lane_dense=True)
    with pytest.raises(ValueError, match=re.escape("the GPU kernels read the plain pool layout")):
        paged_attention(q, dense, dense, lengths, tables, layer=jnp.int32(1), interpret=True, backend="gpu")
    plain = stacked(k, lane_dense=False)
    with pytest.raises(ValueError, match=re.escape("a stacked pool [num_layers, ...] needs the layer index")):
        paged_attention(q, plain, plain, lengths, tables, interpret=True, backend="tpu")
    with pytest.raises(ValueError, match=re.escape("layer must be None for a one-layer pool")):
        paged_attention(q, jnp.asarray(k), jnp.asarray(k), lengths, tables, layer=jnp.int32(0), interpret=True,
                        backend="tpu")
    odd = jnp.zeros((NUM_LAYERS, 2, 4, 16, 96))
    with pytest.raises(ValueError, match=re.escape("the pool's last dimension (96) must be head_dim (64) times")):
        paged_attention(q, odd, odd, lengths, tables, layer=jnp.int32(1), interpret=True, backend="tpu")
