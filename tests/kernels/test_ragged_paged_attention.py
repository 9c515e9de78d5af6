"""Ragged paged attention (both Pallas variants, interpret mode on CPU) and its jnp reference against a naive
float64 numpy attention, on one layer's pool with shuffled pages, float32 and bfloat16 (every KV slot that no
token may see is NaN, and so is every token of q that no row answers): flat batches mixing decode rows and
prefill chunks of 0, 1, query-block-edge (7/8/9, 15/16/17) and multi-block (40) tokens, at page-edge and
mid-page positions, with tokens past their row's length, rows placed in q out of order and off the query
block grid, and tokens of q in no row; with a sliding window and logit soft-cap (KV pages wholly before
a row's window NaN too; stacked pools, plain and lane-dense, read at a layer); the work list; the Mosaic and
Triton lowerings; the input checks.

Tolerances: float32 rtol 2e-5, atol 2e-6 (float32 math on the exact values); bfloat16 rtol = atol = 2e-2
(the kernels round the softmax weights to bfloat16 for the P @ V dot and the output to bfloat16), against
the naive attention over the same bfloat16 values upcast to float64.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import ragged_paged_attention, ragged_paged_attention_reference
from kernels_pallas.ragged_paged_attention import _Items
from tests.kernels.conftest import (
    LOWERING_DTYPES,
    LOWERING_PLATFORMS,
    first_read_page,
    lowering_variants,
    naive_scores,
    naive_softmax,
    pool_at_layer,
    window_keys,
)

PAGE_SIZE, HEAD_DIM = 16, 64
SM_SCALE = HEAD_DIM**-0.5
TOLERANCES = {"f32": dict(rtol=2e-5, atol=2e-6), "bf16": dict(rtol=2e-2, atol=2e-2)}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}

# Rows (query tokens, position of the first, length seen). With query blocks of 8 (or 16):
ROWS = [
    (1, 40, 41),  # a decode row, mid-page
    (1, -1, 0),  # a padding row (length 0)
    (7, 0, 7),  # a chunk from 0, one short of a block of 8
    (8, 16, 24),  # a block of 8, starting on a page edge
    (9, 5, 14),  # one past a block of 8, mid-page
    (0, 30, 30),  # a row of no tokens
    (1, 15, 16),  # decode on the last slot of a page
    (1, 16, 17),  # decode on the first slot of a page
    (15, 33, 48),  # one short of a block of 16, up to the full table
    (16, 16, 32),  # a block of 16 (two of 8), page edge to page edge
    (17, 0, 17),  # one past a block of 16
    (40, 7, 47),  # five blocks of 8 (three of 16), mid-page to mid-page
    (6, 20, 23),  # 3 real tokens, then 3 past the length (padding inside a row)
    (3, -2, 5),  # 2 tokens before position 0 (zeros, like the CPU kernel), then 1 real
]
NUM_REAL = 1 + 7 + 8 + 9 + 1 + 1 + 15 + 16 + 17 + 40 + 3 + 1


def ragged_batch(rng, rows, num_q_heads, num_kv_heads, dtype, *, spare_pages=3):
    """q, k_pages, v_pages, block_tables and the row arrays, numpy (float32 values exact in dtype).

    Rows sit in q in a shuffled order, with 3 tokens in no row before them, one after every other row and
    2 at the end, so they start off the query block grid. Pages are shuffled over the pool."""
    query_lens = np.array([n for n, _, _ in rows], np.int32)
    positions = np.array([p for _, p, _ in rows], np.int32)
    lengths = np.array([length for _, _, length in rows], np.int32)
    query_starts = np.zeros(len(rows), np.int32)
    token = 3
    for i, s in enumerate(rng.permutation(len(rows))):
        query_starts[s] = token
        token += query_lens[s] + i % 2
    num_tokens = token + 2
    pages_per_seq = -(-int(lengths.max()) // PAGE_SIZE)
    num_pages = len(rows) * pages_per_seq + spare_pages
    block_tables = rng.permutation(num_pages)[: len(rows) * pages_per_seq].reshape(len(rows), pages_per_seq)
    shape = (num_kv_heads, num_pages, PAGE_SIZE, HEAD_DIM)
    as_dtype = lambda x: np.array(jnp.asarray(x, dtype).astype(jnp.float32))  # a writable copy
    k_pages, v_pages = as_dtype(rng.standard_normal(shape)), as_dtype(rng.standard_normal(shape))
    q = as_dtype(rng.standard_normal((num_tokens, num_q_heads, HEAD_DIM)))
    row_arrays = (query_starts, query_lens, positions, lengths)
    return q, k_pages, v_pages, block_tables.astype(np.int32), row_arrays


def real_tokens(num_tokens, row_arrays):
    """bool[T]: tokens of a row at a position in [0, length): the ones that get an answer."""
    real = np.zeros(num_tokens, bool)
    for start, count, first, length in zip(*row_arrays, strict=True):
        position = first + np.arange(count)
        real[start : start + count] = (position >= 0) & (position < length)
    return real


def poison(q, k_pages, v_pages, block_tables, row_arrays, first_read=lambda position: 0):
    """NaN in every KV slot that no real token sees (unused pages, slots past each row's last real token,
    slots before ``first_read(position of the row's first token)``) and in every token of q that gets no
    answer (tokens in no row, tokens outside [0, length))."""
    seen = np.zeros(k_pages.shape[1:3], bool)  # [page, slot]
    for s, (_, count, first, length) in enumerate(zip(*row_arrays, strict=True)):
        last = min(first + count, length)  # exclusive: the keys the row's last real token sees
        keys = np.arange(first_read(first), max(last, 0))
        seen[block_tables[s, keys // PAGE_SIZE], keys % PAGE_SIZE] = True
    k_pages[:, ~seen] = np.nan
    v_pages[:, ~seen] = np.nan
    q[~real_tokens(len(q), row_arrays)] = np.nan


def naive_ragged(q, k_pages, v_pages, block_tables, row_arrays, sm_scale, sliding_window=None, logit_softcap=None,
                 sinks=None):
    """Float64, token by token: token i of row s at position positions[s] + i sees positions 0..itself (the
    last ``sliding_window`` of them), scores soft-capped by ``logit_softcap``, exp(sinks[h]) more in head h's
    softmax denominator."""
    group = q.shape[1] // k_pages.shape[0]
    out = np.zeros(q.shape)
    for s, (start, count, first, length) in enumerate(zip(*row_arrays, strict=True)):
        for i in range(count):
            position = first + i
            if not 0 <= position < length:
                continue
            keys = window_keys(position, sliding_window)
            pages, slots = block_tables[s, keys // PAGE_SIZE], keys % PAGE_SIZE
            for h in range(q.shape[1]):
                k = k_pages[h // group, pages, slots].astype(np.float64)
                v = v_pages[h // group, pages, slots].astype(np.float64)
                scores = naive_scores(k, q[start + i, h].astype(np.float64), sm_scale, logit_softcap)
                out[start + i, h] = naive_softmax(scores, v, None if sinks is None else sinks[h])
    return out


def poisoned_case(seed, rows, num_q_heads, num_kv_heads, dtype_name, *, sm_scale=SM_SCALE, sliding_window=None,
                  logit_softcap=None, first_read=lambda position: 0, sinks=None):
    """(kernel args, naive output, real tokens) of a ``ragged_batch``, poisoned (``poison``)."""
    dtype = DTYPES[dtype_name]
    q, k_pages, v_pages, block_tables, row_arrays = ragged_batch(
        np.random.default_rng(seed), rows, num_q_heads, num_kv_heads, dtype
    )
    expected = naive_ragged(q, k_pages, v_pages, block_tables, row_arrays, sm_scale, sliding_window, logit_softcap,
                            sinks)
    poison(q, k_pages, v_pages, block_tables, row_arrays, first_read)
    args = (
        jnp.asarray(q, dtype),
        jnp.asarray(k_pages, dtype),
        jnp.asarray(v_pages, dtype),
        jnp.asarray(block_tables),
        *(jnp.asarray(x) for x in row_arrays),
    )
    return args, expected, real_tokens(len(q), row_arrays)


def check(out, expected, real, dtype_name):
    out = np.asarray(out.astype(jnp.float32))
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, **TOLERANCES[dtype_name])
    np.testing.assert_array_equal(out[~real], 0.0)  # tokens in no row and padding tokens: exact zeros


HEADS = [(9, 3), (4, 4), (8, 2)]


@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
@pytest.mark.parametrize("heads", HEADS, ids=[f"{qh}q{kh}kv" for qh, kh in HEADS])
def test_tpu_kernel_and_reference_match_naive_attention_on_a_mixed_batch(heads, dtype_name):
    args, expected, real = poisoned_case(sum(heads), ROWS, *heads, dtype_name)
    assert len(real) == 137 and real.sum() == NUM_REAL  # 3 + 125 row tokens + 7 gaps + 2
    out = ragged_paged_attention(
        *args, sm_scale=SM_SCALE, backend="tpu", interpret=True, block_q=8, pages_per_compute_block=2
    )
    assert out.dtype == args[0].dtype
    check(out, expected, real, dtype_name)
    check(ragged_paged_attention_reference(*args, sm_scale=SM_SCALE), expected, real, dtype_name)


# a single token per item: one item per token, so the rows of one to nine tokens, padding and empty rows only
SINGLE_TOKEN_ROWS = [ROWS[i] for i in (0, 1, 2, 4, 5, 6, 12, 13)]


@pytest.mark.parametrize(
    "backend,dtype_name,heads,knobs,rows",
    [
        ("tpu", "f32", (8, 2), {}, ROWS),  # the tuned defaults: query blocks of 16, 8 pages per KV block (capped: 2)
        ("tpu", "bf16", (9, 3), {"block_q": 16, "pages_per_compute_block": 1}, ROWS),
        ("tpu", "f32", (4, 4), {"block_q": 1, "pages_per_compute_block": 4}, SINGLE_TOKEN_ROWS),
        ("gpu", "f32", (9, 3), {"block_q": 8, "pages_per_compute_block": 2}, ROWS),  # a group of 3 padded to 4 heads
        ("gpu", "f32", (4, 4), {"block_q": 4}, ROWS),  # a group of 1 padded to 4 heads: Triton's 16 rows
        ("gpu", "bf16", (8, 2), {}, ROWS),
    ],
    ids=["tpu-defaults", "tpu-bf16-one-page-blocks", "tpu-single-token-items", "gpu-group-of-3", "gpu-group-of-1",
         "gpu-bf16-defaults"],
)
def test_kernel_knobs_and_the_gpu_variant(backend, dtype_name, heads, knobs, rows):
    args, expected, real = poisoned_case(7, rows, *heads, dtype_name)
    out = ragged_paged_attention(*args, sm_scale=SM_SCALE, backend=backend, interpret=True, **knobs)
    check(out, expected, real, dtype_name)


# (backend, dtype, sliding_window, logit_softcap, pool layout) on rows of every kind in ROWS and two longer
# ones (contexts of 101 and 110 tokens), so each window is wider than some contexts and narrower than others.
VARIANTS = [
    ("tpu", "f32", 5, 5.0, "lane-dense"),  # a window inside a page
    ("tpu", "bf16", 40, 5.0, "stacked"),  # a window over several pages
    ("gpu", "f32", 20, 5.0, "stacked"),
]
VARIANT_ROWS = [ROWS[i] for i in (0, 1, 4, 5, 7, 10, 12, 13)] + [(1, 100, 101), (20, 90, 110)]
VARIANT_SM_SCALE = 0.5  # scores of std ~4 at head_dim 64: the cap 5 changes them


@pytest.mark.parametrize("backend,dtype_name,window,cap,layout", VARIANTS)
def test_sliding_window_and_softcap_match_naive_attention(backend, dtype_name, window, cap, layout):
    """Pages wholly before the window of a row's first token (before its block for the GPU variant) are NaN:
    never read."""
    first_read = lambda position: first_read_page(position, window, PAGE_SIZE, backend, 2) * PAGE_SIZE
    variants = dict(sm_scale=VARIANT_SM_SCALE, sliding_window=window, logit_softcap=cap)
    args, expected, real = poisoned_case(11, VARIANT_ROWS, 4, 1, dtype_name, first_read=first_read, **variants)
    q, k_pages, v_pages, *rest = args
    (k_pool, layer), (v_pool, _) = (pool_at_layer(x, layout) for x in (k_pages, v_pages))
    out = ragged_paged_attention(
        q, k_pool, v_pool, *rest, layer=layer, backend=backend, interpret=True, block_q=8, pages_per_compute_block=2,
        **variants,
    )
    check(out, expected, real, dtype_name)
    check(ragged_paged_attention_reference(*args, **variants), expected, real, dtype_name)
    for without_one in ({"sliding_window": None}, {"logit_softcap": None}):  # each changes the result
        _, other, _ = poisoned_case(11, VARIANT_ROWS, 4, 1, dtype_name, **(variants | without_one))
        assert np.abs(expected - other).max() > 0.1


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_a_traced_window_gives_each_windows_result_from_one_program(backend):
    """The layer's own window as an operand (0: none), on a stacked pool read at a layer: the naive attention
    with that window, and pages wholly before a row's window (before its block for the GPU variant) never
    read."""
    first_read = lambda position: first_read_page(position, 20, PAGE_SIZE, backend, 2) * PAGE_SIZE
    cases = {20: poisoned_case(13, VARIANT_ROWS, 4, 1, "f32", sliding_window=20, first_read=first_read),
             0: poisoned_case(13, VARIANT_ROWS, 4, 1, "f32")}
    q, _, _, *rest = cases[0][0]
    run = jax.jit(lambda k, v, layer, window: ragged_paged_attention(
        q, k, v, *rest, layer=layer, sm_scale=SM_SCALE, backend=backend, interpret=True, block_q=8,
        pages_per_compute_block=2, sliding_window=window))
    for window, (args, expected, real) in cases.items():
        (k_pool, layer), (v_pool, _) = (pool_at_layer(x, "stacked") for x in args[1:3])
        check(run(k_pool, v_pool, layer, jnp.int32(window)), expected, real, "f32")
    assert run._cache_size() == 1
    assert np.abs(cases[20][1] - cases[0][1]).max() > 0.1


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_sinks_add_a_logit_per_head_to_each_softmax_denominator(backend):
    """gpt-oss's attention sinks (GQA 9:3: a group of 3 heads, padded to 4 on the GPU), with a window, on every
    kind of row: the naive softmax with exp(sink) more in each head's denominator."""
    sinks = np.random.default_rng(17).normal(0.0, 1.0, 9).astype(np.float32)
    args, expected, real = poisoned_case(17, VARIANT_ROWS, 9, 3, "f32", sliding_window=20, sinks=sinks)
    out = ragged_paged_attention(*args, sm_scale=SM_SCALE, backend=backend, interpret=True, block_q=8,
                                 pages_per_compute_block=2, sliding_window=20, sinks=jnp.asarray(sinks))
    check(out, expected, real, "f32")
    _, without, _ = poisoned_case(17, VARIANT_ROWS, 9, 3, "f32", sliding_window=20)
    assert np.abs(expected - without).max() > 0.05


@lowering_variants(num_q_heads=8)
@LOWERING_PLATFORMS
@LOWERING_DTYPES
def test_lowers_for_real_hardware(kernel_backend, platform, dtype, pool_dtype, variants):
    """Runs the Mosaic / Triton lowering (no device needed) so unsupported ops fail here, not on hardware; a
    float8 pool (the float8 KV cache) and an int8 pool with its scales (the int8 KV cache) under a bfloat16
    query too."""
    if pool_dtype == jnp.int8:
        scales = jax.ShapeDtypeStruct((3, 2, 40, 16), jnp.float32)
        variants = variants | dict(k_scales=scales, v_scales=scales)
    rows = jax.ShapeDtypeStruct((4,), jnp.int32)
    args = (
        jax.ShapeDtypeStruct((50, 8, 64), dtype),
        jax.ShapeDtypeStruct((3, 2, 40, 16, 64), pool_dtype),
        jax.ShapeDtypeStruct((3, 2, 40, 16, 64), pool_dtype),
        jax.ShapeDtypeStruct((4, 8), jnp.int32),
        rows, rows, rows, rows,
    )
    traced = ragged_paged_attention.trace(
        *args, layer=jax.ShapeDtypeStruct((), jnp.int32), sm_scale=SM_SCALE, backend=kernel_backend, **variants
    )
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert ("tpu_custom_call" if platform == "tpu" else "triton") in text


def test_a_decode_only_batch_lengths_past_the_table_and_garbage_table_entries():
    """Only decode rows, back to back (T == S: one item per row), one length past the block table (clamped
    to it), and block-table entries that no token needs holding out-of-range page numbers."""
    rows = [(1, 0, 1), (1, 15, 16), (1, 16, 17), (1, 47, 48), (1, 30, 31), (1, 33, 34)]
    args, _, _ = poisoned_case(3, rows, 8, 2, "f32")
    q, k_pages, v_pages, block_tables, query_starts, query_lens, positions, lengths = args
    q = q[query_starts]  # the rows' tokens without the gaps between them
    query_starts = jnp.arange(len(rows), dtype=jnp.int32)
    expected = naive_ragged(*(np.asarray(x) for x in (q, k_pages, v_pages, block_tables)),
                            (query_starts, query_lens, positions, lengths), SM_SCALE)
    table = np.asarray(block_tables).copy()
    table[0, 1:], table[4, 2] = [10**6, -7], 999
    row_arrays = (query_starts, query_lens, positions, lengths.at[3].set(60))  # 60 > 3 pages of 16
    items = _Items(*row_arrays, num_tokens=len(rows), block_q=16, num_items=len(rows))
    np.testing.assert_array_equal(items.rows, np.arange(len(rows)))
    out = ragged_paged_attention(q, k_pages, v_pages, jnp.asarray(table), *row_arrays, sm_scale=SM_SCALE,
                                 backend="tpu", interpret=True, block_q=16)
    np.testing.assert_allclose(np.asarray(out), expected, **TOLERANCES["f32"])
    ref = ragged_paged_attention_reference(q, k_pages, v_pages, jnp.asarray(table), *row_arrays, sm_scale=SM_SCALE)
    np.testing.assert_allclose(np.asarray(ref), expected, **TOLERANCES["f32"])


def test_empty_rows_only_give_zeros():
    rows = [(0, 0, 5), (1, -1, 0), (0, 3, 3)]
    args, _, real = poisoned_case(5, rows, 4, 4, "f32")
    assert not real.any()
    out = ragged_paged_attention(*args, sm_scale=SM_SCALE, backend="tpu", interpret=True, block_q=8)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


@functools.partial(jax.jit, static_argnames=("num_tokens", "block_q", "num_items"))
def work_list(query_starts, query_lens, positions, lengths, *, num_tokens, block_q, num_items):
    items = _Items(query_starts, query_lens, positions, lengths, num_tokens=num_tokens, block_q=block_q,
                   num_items=num_items)
    return items.rows, items.first_pos, items.kv_end, items.token


@pytest.mark.parametrize("block_q", [1, 4, 8, 16])
def test_the_work_list_covers_every_row_token_once_within_the_static_bound(block_q):
    """Random rows (in shuffled order in q, some of 0 and 1 tokens): with the rows tiling all of q, or with
    gaps between them, every row token is in exactly one item, of consecutive tokens of one row, and the
    items fit in (T + S * (block_q - 1)) // block_q."""
    rng = np.random.default_rng(block_q)
    num_rows, num_tokens = 8, 160
    num_items = (num_tokens + num_rows * (block_q - 1)) // block_q
    for trial in range(30):
        if trial % 2:  # rows tile q: boundaries at sorted random cuts (repeats give empty rows)
            cuts = np.sort(np.concatenate([[0, num_tokens], rng.integers(0, num_tokens + 1, num_rows - 1)]))
            query_starts, query_lens = cuts[:-1], np.diff(cuts)
        else:  # rows with gaps
            bounds = np.sort(rng.integers(0, num_tokens + 1, 2 * num_rows)).reshape(num_rows, 2)
            query_starts, query_lens = bounds[:, 0], bounds[:, 1] - bounds[:, 0]
        order = rng.permutation(num_rows)
        query_starts, query_lens = query_starts[order].astype(np.int32), query_lens[order].astype(np.int32)
        positions = rng.integers(-2, 30, num_rows).astype(np.int32)
        lengths = (positions + query_lens - rng.integers(0, 3, num_rows)).astype(np.int32)
        rows, first_pos, kv_end, token = (
            np.asarray(x)
            for x in work_list(*(jnp.asarray(x) for x in (query_starts, query_lens, positions, lengths)),
                               num_tokens=num_tokens, block_q=block_q, num_items=num_items)
        )
        covered = np.sort(token[token < num_tokens])
        wanted = np.concatenate([np.arange(a, a + n) for a, n in zip(query_starts, query_lens, strict=True)])
        np.testing.assert_array_equal(covered, np.sort(wanted))
        for w in range(num_items):  # an item's tokens are consecutive tokens of its one row
            slots = token[w][token[w] < num_tokens]
            if not len(slots):
                assert kv_end[w] == 0
                continue
            s = rows[w]
            np.testing.assert_array_equal(slots, slots[0] + np.arange(len(slots)))
            assert query_starts[s] <= slots[0] and slots[-1] < query_starts[s] + query_lens[s]
            assert first_pos[w] == positions[s] + slots[0] - query_starts[s]
            assert kv_end[w] == max(0, min(lengths[s], first_pos[w] + len(slots)))


def test_input_checks_raise_clear_errors():
    args, _, _ = poisoned_case(1, ROWS[:4], 9, 3, "f32")
    q, k_pages, v_pages, block_tables, query_starts, query_lens, positions, lengths = args
    rows = (query_starts, query_lens, positions, lengths)
    bad = [
        ((q[None], k_pages, v_pages, block_tables, *rows), f"q must be [num_tokens, num_q_heads, head_dim], got "
         f"shape (1, {len(q)}, 9, 64)"),
        ((q.astype(jnp.bfloat16), k_pages, v_pages, block_tables, *rows),
         "q dtype (bfloat16) must match the k_pages/v_pages dtype (float32)"),
        ((q[:, :5], k_pages, v_pages, block_tables, *rows), "num_q_heads (5) must be a multiple of num_kv_heads (3)"),
        ((q, k_pages, v_pages[:, :-1], block_tables, *rows), "k_pages and v_pages must have the same shape, got "
         f"{k_pages.shape} and {v_pages[:, :-1].shape}"),
        ((q, k_pages, v_pages.astype(jnp.bfloat16), block_tables, *rows),
         "k_pages and v_pages must have the same dtype, got float32 and bfloat16"),
        ((q.astype(jnp.float16), k_pages.astype(jnp.float16), v_pages.astype(jnp.float16), block_tables, *rows),
         "k_pages dtype must be float32, bfloat16, float8_e4m3fn or int8, got float16"),
        ((q, k_pages, v_pages, block_tables[0], *rows), "block_tables must have shape (num_rows, pages_per_seq), "
         f"got ({block_tables.shape[1]},)"),
        ((q, k_pages, v_pages, block_tables.astype(jnp.int16), *rows), "block_tables must be int32, got int16"),
        ((q, k_pages, v_pages, block_tables, query_starts, query_lens[:3], positions, lengths),
         "query_lens must have shape (num_rows,) = (4,) like block_tables' first dim, got (3,)"),
        ((q, k_pages, v_pages, block_tables, query_starts, query_lens, positions.astype(jnp.float32), lengths),
         "positions must be int32, got float32"),
    ]
    for call_args, message in bad:
        for fn in (ragged_paged_attention, ragged_paged_attention_reference):
            with pytest.raises(ValueError, match=re.escape(message)):
                fn(*call_args, sm_scale=SM_SCALE, **({"interpret": True} if fn is ragged_paged_attention else {}))
    knob_errors = [
        ({"block_q": 12}, "block_q must be a power of two >= 1, got 12"),
        ({"pages_per_compute_block": 0}, "pages_per_compute_block must be a power of two >= 1, got 0"),
        ({"backend": "tpu", "num_warps": 4}, "num_warps is a knob of the other backend; it is not used by "
         "backend='tpu'"),
        ({"backend": "cuda"}, "backend must be one of ('auto', 'tpu', 'gpu'), got 'cuda'"),
        ({"sliding_window": -4}, "sliding_window must be an int >= 1 (None or 0: no window), got -4"),
        ({"logit_softcap": -1.0}, "logit_softcap must be finite and > 0 (None or 0: no soft-cap), got -1.0"),
    ]
    for knobs, message in knob_errors:
        with pytest.raises(ValueError, match=re.escape(message)):
            ragged_paged_attention(*args, sm_scale=SM_SCALE, interpret=True, **knobs)
    with pytest.raises(ValueError, match=re.escape("backend='auto' found no accelerator (platform 'cpu')")):
        ragged_paged_attention(*args, sm_scale=SM_SCALE)
