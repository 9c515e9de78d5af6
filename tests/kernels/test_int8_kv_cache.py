"""The three kernels over the int8 KV cache (`kv_cache_dtype="int8"`: int8 K/V with a float32 scale per token
and kv head, `k_scales` / `v_scales`): each variant (TPU in the plain and the lane-dense layout, GPU), in
interpret mode on CPU, gives what the jnp reference gives on the dequantized float32 pool (values * scales),
with a sliding window and soft-cap in some cases. Slots no token may see (unused pages, slots past a
sequence's length in its last page, pages before a windowed walk's first page, the other layers of the
stacked pool) hold random int8 values and NaN scales: a kernel that lets one of them in returns NaN. The
references read the int8 pool through its scales too; the scale checks.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import (
    paged_attention,
    paged_attention_reference,
    prefill_attention,
    prefill_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from tests.kernels.conftest import STACK_LAYER, STACK_LAYERS, first_read_page
from tests.kernels.test_paged_attention import assert_close
from tests.kernels.test_prefill_attention import assert_close_on_real_rows, chunk_layout
from tests.kernels.test_ragged_paged_attention import PAGE_SIZE, ROWS, check, poisoned_case

HEAD_DIM = 64  # two tokens per 128-lane row in the lane-dense layout
VARIANT = dict(sm_scale=0.5, sliding_window=20, logit_softcap=5.0)


def quantize(pages, rng):
    """(int8 values, f32 scales, f32 values * scales) of pages f32[..., D] per row (token and kv head): scale
    max|x| / 127; rows holding NaN (no token may see them) get random values and a NaN scale."""
    pages = np.asarray(pages, np.float32)
    dead = np.isnan(pages).any(axis=-1)
    x = np.nan_to_num(pages)
    scales = np.abs(x).max(axis=-1) / 127
    values = np.rint(x / np.where(scales == 0, 1, scales)[..., None]).astype(np.int8)
    values[dead] = rng.integers(-128, 128, (dead.sum(), pages.shape[-1]))
    scales[dead] = np.nan
    return values, scales, values.astype(np.float32) * scales[..., None]


def int8_pool(pages, layout: str, rng):
    """(pool, scales, layer, dequantized one-layer pages) of float pages [Hkv, P, page_size, D]: as one
    layer ("one-layer") or as layer STACK_LAYER of an int8 pool of STACK_LAYERS layers ("stacked", or
    "lane-dense": 128 // D tokens per pool row), the other layers random with NaN scales."""
    values, scales, dequantized = quantize(pages, rng)
    if layout == "one-layer":
        return jnp.asarray(values), jnp.asarray(scales), None, jnp.asarray(dequantized)
    pool = rng.integers(-128, 128, (STACK_LAYERS, *values.shape)).astype(np.int8)
    all_scales = np.full((STACK_LAYERS, *scales.shape), np.nan, np.float32)
    pool[STACK_LAYER], all_scales[STACK_LAYER] = values, scales
    if layout == "lane-dense":  # token t of a page: row t // 2, lanes (t % 2) * D onwards
        num_kv_heads, total_pages, page_size, head_dim = values.shape
        pool = pool.reshape(STACK_LAYERS, num_kv_heads, total_pages, page_size // 2, 2 * head_dim)
    return jnp.asarray(pool), jnp.asarray(all_scales), jnp.int32(STACK_LAYER), jnp.asarray(dequantized)


def int8_kv(k_pages, v_pages, layout: str, rng):
    """(kernel keyword arguments of the int8 pool, (dequantized k, v))."""
    (k_pool, k_scales, layer, k), (v_pool, v_scales, _, v) = (int8_pool(x, layout, rng) for x in (k_pages, v_pages))
    return dict(k_pages=k_pool, v_pages=v_pool, k_scales=k_scales, v_scales=v_scales, layer=layer), (k, v)


def poison_scales_before(pool: dict, page_indices, first_pages) -> dict:
    """``pool`` with NaN scales in every page of sequence s before its block-table entry first_pages[s] (the
    pages a windowed kernel skips, ``conftest.first_read_page``)."""
    table = np.asarray(page_indices)
    skipped = np.concatenate([table[s, :first] for s, first in enumerate(first_pages)]).astype(int)
    at = (slice(None), skipped) if pool["layer"] is None else (pool["layer"], slice(None), skipped)
    return pool | {name: pool[name].at[at].set(jnp.nan) for name in ("k_scales", "v_scales")}


# (backend, pool layout, variants) per kernel: the TPU variant in the lane-dense layout with a sliding window
# (a walk from any page: scale windows at any offset) and soft-cap, the plain layout (decode, ragged), the GPU
# variant. Kept few: each case is a kernel compile in interpret mode (about 2 s).
DECODE_CASES = [("tpu", "stacked", {}), ("tpu", "lane-dense", VARIANT), ("gpu", "one-layer", VARIANT)]
PREFILL_CASES = [("tpu", "lane-dense", VARIANT), ("gpu", "stacked", VARIANT)]
RAGGED_CASES = [("tpu", "lane-dense", VARIANT), ("tpu", "one-layer", {}), ("gpu", "stacked", {})]


def case_id(case) -> str:
    backend, layout, variants = case
    return f"{backend}-{layout}" + ("-window-cap" if variants else "")


@pytest.mark.parametrize("case", DECODE_CASES, ids=map(case_id, DECODE_CASES))
def test_decode_over_an_int8_pool_is_attention_over_its_dequantized_values(case, rng, make_kv):
    backend, layout, variants = case
    lengths = [1, 17, 48]  # a page + 1 (15 slots past the length in its last page) and the full table
    kv = make_kv(rng, lengths=lengths, num_kv_heads=2, head_dim=HEAD_DIM, page_size=16, pages_per_seq=3,
                 dtype=jnp.float32)
    window = variants.get("sliding_window")
    first_pages = [first_read_page(n - 1, window, 16, backend, 2) for n in lengths]
    pool, (k, v) = int8_kv(kv.k_pages, kv.v_pages, layout, rng)
    q = jnp.asarray(rng.standard_normal((len(lengths), 4, HEAD_DIM)), jnp.float32)
    knobs = {"pages_per_compute_block": 2} | ({"num_splits": 2} if backend == "gpu" else {})
    poisoned = poison_scales_before(pool, kv.page_indices, first_pages)
    out = paged_attention(q, **poisoned, lengths=kv.lengths, page_indices=kv.page_indices, backend=backend,
                          interpret=True, **knobs, **variants)
    want = paged_attention_reference(q, k, v, kv.lengths, kv.page_indices, **variants)
    assert_close(out, want, jnp.float32, lambda _: 1e-5)
    if layout == "lane-dense":  # the reference reads the int8 pool through its scales too
        ref = paged_attention_reference(q, **pool, lengths=kv.lengths, page_indices=kv.page_indices, **variants)
        assert_close(ref, want, jnp.float32, lambda _: 1e-5)


@pytest.mark.parametrize("case", PREFILL_CASES, ids=map(case_id, PREFILL_CASES))
def test_prefill_over_an_int8_pool_is_attention_over_its_dequantized_values(case, rng, make_kv):
    backend, layout, variants = case
    q_start, lengths = (x[[0, 3, 4]] for x in chunk_layout(16, 3, 20))  # chunks of 1, 17 and 17 of 48 tokens
    kv = make_kv(rng, lengths=list(lengths), num_kv_heads=2, head_dim=HEAD_DIM, page_size=16, pages_per_seq=3,
                 dtype=jnp.float32)
    window = variants.get("sliding_window")
    first_pages = [first_read_page(int(p), window, 16, backend, 2) for p in q_start]
    pool, (k, v) = int8_kv(kv.k_pages, kv.v_pages, layout, rng)
    q = jnp.asarray(rng.standard_normal((len(lengths), 20, 4, HEAD_DIM)), jnp.bfloat16)
    rows = dict(page_indices=kv.page_indices, q_start=jnp.asarray(q_start), lengths=kv.lengths)
    poisoned = poison_scales_before(pool, kv.page_indices, first_pages)
    out = prefill_attention(q, **poisoned, **rows, backend=backend, interpret=True, block_q=16,
                            pages_per_compute_block=2, **variants)
    assert out.dtype == jnp.bfloat16
    want = prefill_attention_reference(q.astype(jnp.float32), k, v, **rows, **variants)
    assert_close_on_real_rows(out, want, q_start, lengths, 2e-2)
    if layout == "lane-dense":
        ref = prefill_attention_reference(q, **pool, **rows, **variants)
        assert_close_on_real_rows(ref, want, q_start, lengths, 2e-2)


@pytest.mark.parametrize("case", RAGGED_CASES, ids=map(case_id, RAGGED_CASES))
def test_ragged_over_an_int8_pool_is_attention_over_its_dequantized_values(case, rng):
    backend, layout, variants = case
    rows = [ROWS[i] for i in (0, 1, 4, 5, 10, 12)]  # decode, padding, chunks of 9 and 17, empty, 3 + 3 padding
    window = variants.get("sliding_window")
    first_read = lambda position: first_read_page(position, window, PAGE_SIZE, backend, 2) * PAGE_SIZE
    args, _, real = poisoned_case(17, rows, 4, 2, "f32", first_read=first_read, **variants)
    q, k_pages, v_pages, block_tables, *row_arrays = args
    pool, (k, v) = int8_kv(k_pages, v_pages, layout, rng)
    sm_scale = variants.get("sm_scale", HEAD_DIM**-0.5)
    variants = variants | {"sm_scale": sm_scale}
    out = ragged_paged_attention(q, **pool, block_tables=block_tables, query_starts=row_arrays[0],
                                 query_lens=row_arrays[1], positions=row_arrays[2], lengths=row_arrays[3],
                                 backend=backend, interpret=True, block_q=8, pages_per_compute_block=2, **variants)
    want = np.asarray(ragged_paged_attention_reference(q, k, v, block_tables, *row_arrays, **variants))
    check(out, want, real, "f32")
    if layout == "lane-dense":
        ref = ragged_paged_attention_reference(q, **pool, block_tables=block_tables, query_starts=row_arrays[0],
                                               query_lens=row_arrays[1], positions=row_arrays[2],
                                               lengths=row_arrays[3], **variants)
        check(ref, want, real, "f32")


# ----------------------------------------------------------------------------------------- validation


def _pool_args(pool_dtype=jnp.int8, k_scales=(2, 6, 16), v_scales=(2, 6, 16), scales_dtype=jnp.float32):
    pages = jnp.zeros((2, 6, 16, 64), pool_dtype)
    scales = lambda shape: None if shape is None else jnp.ones(shape, scales_dtype)
    return dict(k_pages=pages, v_pages=pages, k_scales=scales(k_scales), v_scales=scales(v_scales))


BAD_SCALES = [
    (dict(k_scales=None, v_scales=None), "an int8 pool needs k_scales and v_scales (float32, a scale per token"),
    (dict(pool_dtype=jnp.bfloat16), "k_scales/v_scales are read only with an int8 pool, got a bfloat16 pool"),
    (dict(v_scales=None), "k_scales and v_scales must be given together (an int8 pool needs both)"),
    (dict(k_scales=None), "k_scales and v_scales must be given together (an int8 pool needs both)"),
    (dict(v_scales=(2, 6, 8)), "v_scales must have shape (2, 6, 16) ([num_kv_heads, total_pages, page_size] of "
     "the pool), got (2, 6, 8)"),
    (dict(k_scales=(1, 2, 6, 16)), "k_scales must have shape (2, 6, 16) ([num_kv_heads, total_pages, page_size] "
     "of the pool), got (1, 2, 6, 16)"),
    (dict(scales_dtype=jnp.bfloat16), "k_scales must be float32, got bfloat16"),
]


@pytest.mark.parametrize("change,message", BAD_SCALES)
def test_scale_checks(change, message):
    pool = _pool_args(**change)
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    lengths, tables = jnp.ones((2,), jnp.int32), jnp.zeros((2, 3), jnp.int32)
    calls = [
        lambda **kw: paged_attention(q, **pool, lengths=lengths, page_indices=tables, **kw),
        lambda **kw: prefill_attention(q[:, None], **pool, page_indices=tables, q_start=lengths, lengths=lengths, **kw),
        lambda **kw: ragged_paged_attention(q, **pool, block_tables=tables, query_starts=lengths, query_lens=lengths,
                                           positions=lengths, lengths=lengths, sm_scale=0.1, **kw),
    ]
    for call in calls:
        for kw in ({"backend": "tpu", "interpret": True}, {"backend": "gpu", "interpret": True}):
            with pytest.raises(ValueError, match=re.escape(message)):
                call(**kw)
    with pytest.raises(ValueError, match=re.escape(message)):
        paged_attention_reference(q, **pool, lengths=lengths, page_indices=tables)


def test_stacked_scales_must_match_the_stacked_pool():
    pool = jnp.zeros((3, 2, 6, 8, 128), jnp.int8)  # lane-dense, page_size 16, head_dim 64
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    args = dict(lengths=jnp.ones((2,), jnp.int32), page_indices=jnp.zeros((2, 3), jnp.int32), layer=1,
                backend="tpu", interpret=True)
    with pytest.raises(ValueError, match=re.escape(
        "k_scales must have shape (3, 2, 6, 16) ([num_layers, num_kv_heads, total_pages, page_size] of the pool), "
        "got (3, 2, 6, 8)"
    )):
        paged_attention(q, pool, pool, k_scales=jnp.ones((3, 2, 6, 8)), v_scales=jnp.ones((3, 2, 6, 16)), **args)
    message = "q dtype (float16) must be float32 or bfloat16 over a pool of int8"
    with pytest.raises(ValueError, match=re.escape(message)):
        paged_attention(q.astype(jnp.float16), pool, pool, k_scales=jnp.ones((3, 2, 6, 16)),
                        v_scales=jnp.ones((3, 2, 6, 16)), **args)
