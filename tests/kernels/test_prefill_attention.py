"""Chunked-prefill kernel (both Pallas variants, interpret mode on CPU) against the jnp reference, and the
reference against a naive numpy causal attention; with a sliding window and logit soft-cap, kernel and
reference against the naive attention (pages before the window NaN; stacked pools, plain and lane-dense,
read at a layer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.prefill_attention import prefill_attention, prefill_attention_reference
from tests.kernels.conftest import (
    LOWERING_DTYPES,
    LOWERING_PLATFORMS,
    first_read_page,
    lowering_variants,
    poison_pages_before,
    pool_at_layer,
)

# (dtype, page_size, num_q_heads, num_kv_heads, head_dim, pages_per_seq, chunk_len)
CASES = [
    (jnp.float32, 16, 4, 4, 64, 3, 20),  # MHA; two query blocks of 16
    (jnp.bfloat16, 16, 8, 2, 128, 3, 12),  # GQA 4:1
    (jnp.float32, 32, 9, 3, 128, 2, 20),  # GQA 3:1
    (jnp.bfloat16, 32, 4, 4, 64, 3, 20),
    (jnp.float32, 128, 8, 2, 64, 2, 20),
    (jnp.bfloat16, 128, 9, 3, 64, 2, 9),
]
CASE_IDS = [f"{d.__name__}-ps{ps}-{qh}q{kh}kv-d{hd}-c{c}" for d, ps, qh, kh, hd, _, c in CASES]


def chunk_layout(page_size, pages_per_seq, chunk_len):
    """(q_start, lengths): contexts of 1, a page -1/0/+1 and the full table; chunks at q_start 0 and later,
    full and partial (padding rows)."""
    lengths = np.array([1, page_size - 1, page_size, page_size + 1, page_size * pages_per_seq])
    real = np.minimum([1, chunk_len, chunk_len // 2, chunk_len, chunk_len - 3], lengths)
    return (lengths - real).astype(np.int32), lengths.astype(np.int32)


def make_inputs(
    rng, make_kv, dtype, page_size, num_q_heads, num_kv_heads, head_dim, pages_per_seq, chunk_len
):
    q_start, lengths = chunk_layout(page_size, pages_per_seq, chunk_len)
    kv = make_kv(
        rng,
        lengths=list(lengths),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        dtype=dtype,
    )
    q = jnp.asarray(rng.standard_normal((len(lengths), chunk_len, num_q_heads, head_dim)), dtype)
    return q, kv, jnp.asarray(q_start)


def real_rows(q_start, lengths):
    return [int(n) for n in np.asarray(lengths) - np.asarray(q_start)]


def assert_close_on_real_rows(out, ref, q_start, lengths, tol):
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    for s, n in enumerate(real_rows(q_start, lengths)):
        np.testing.assert_allclose(out[s, :n], ref[s, :n], atol=tol, rtol=tol, err_msg=f"sequence {s}")
        np.testing.assert_array_equal(out[s, n:], 0.0, err_msg=f"padding rows of sequence {s}")


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_kernel_matches_reference(case, backend, rng, make_kv, tol):
    dtype, page_size, num_q_heads, num_kv_heads, head_dim, pages_per_seq, chunk_len = case
    q, kv, q_start = make_inputs(
        rng, make_kv, dtype, page_size, num_q_heads, num_kv_heads, head_dim, pages_per_seq, chunk_len
    )
    args = (q, kv.k_pages, kv.v_pages, kv.page_indices, q_start, kv.lengths)
    out = prefill_attention(*args, backend=backend, interpret=True, block_q=16, pages_per_compute_block=2)
    ref = prefill_attention_reference(*args)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close_on_real_rows(out, ref, q_start, kv.lengths, tol(dtype))


@pytest.mark.parametrize(
    "backend,knobs",
    [
        ("tpu", {}),  # tuned-table defaults
        ("tpu", {"block_q": 32, "pages_per_compute_block": 1}),
        ("gpu", {}),
        ("gpu", {"block_q": 32, "pages_per_compute_block": 4}),
    ],
)
def test_tuning_knobs(backend, knobs, rng, make_kv, tol):
    q, kv, q_start = make_inputs(rng, make_kv, jnp.float32, 16, 6, 2, 64, 4, 40)
    args = (q, kv.k_pages, kv.v_pages, kv.page_indices, q_start, kv.lengths)
    out = prefill_attention(*args, backend=backend, interpret=True, sm_scale=0.2, **knobs)
    ref = prefill_attention_reference(*args, sm_scale=0.2)
    assert_close_on_real_rows(out, ref, q_start, kv.lengths, tol(jnp.float32))


@pytest.mark.parametrize("case", CASES[:3], ids=CASE_IDS[:3])
def test_reference_matches_naive_numpy(case, rng, make_kv, naive, tol):
    dtype, page_size, num_q_heads, num_kv_heads, head_dim, pages_per_seq, chunk_len = case
    q, kv, q_start = make_inputs(
        rng, make_kv, dtype, page_size, num_q_heads, num_kv_heads, head_dim, pages_per_seq, chunk_len
    )
    ref = prefill_attention_reference(q, kv.k_pages, kv.v_pages, kv.page_indices, q_start, kv.lengths)
    ref = np.asarray(ref.astype(jnp.float32))
    q64 = np.asarray(q.astype(jnp.float32), np.float64)
    for s, n in enumerate(real_rows(q_start, kv.lengths)):
        positions = int(q_start[s]) + np.arange(n)
        want = naive(q64[s, :n], kv.k_dense[s], kv.v_dense[s], positions, 1 / np.sqrt(head_dim))
        np.testing.assert_allclose(ref[s, :n], want, atol=tol(dtype), rtol=tol(dtype))
        np.testing.assert_array_equal(ref[s, n:], 0.0)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_block_table_padding_is_never_dereferenced(backend, rng, make_kv, tol):
    """Entries past a sequence's length may hold anything, even out-of-range page numbers."""
    q, kv, q_start = make_inputs(rng, make_kv, jnp.float32, 16, 4, 2, 64, 3, 20)
    used = (np.asarray(kv.lengths)[:, None] + 15) // 16
    garbage = np.where(np.arange(3)[None, :] < used, np.asarray(kv.page_indices), -3)
    table = jnp.asarray(garbage, jnp.int32)
    out = prefill_attention(
        q, kv.k_pages, kv.v_pages, table, q_start, kv.lengths, backend=backend, interpret=True, block_q=16
    )
    ref = prefill_attention_reference(q, kv.k_pages, kv.v_pages, kv.page_indices, q_start, kv.lengths)
    assert_close_on_real_rows(out, ref, q_start, kv.lengths, tol(jnp.float32))


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_head_dim_256(backend, rng, make_kv, tol):
    q, kv, q_start = make_inputs(rng, make_kv, jnp.bfloat16, 32, 2, 1, 256, 2, 16)
    args = (q, kv.k_pages, kv.v_pages, kv.page_indices, q_start, kv.lengths)
    out = prefill_attention(*args, backend=backend, interpret=True)
    assert_close_on_real_rows(out, prefill_attention_reference(*args), q_start, kv.lengths, tol(jnp.bfloat16))


def test_single_token_chunk_equals_decode(rng, make_kv):
    """A one-token chunk at the end of the context is a decode step."""
    from kernels_pallas.paged_attention import paged_attention_reference

    q, kv, _ = make_inputs(rng, make_kv, jnp.float32, 16, 4, 2, 64, 3, 1)
    q_start = kv.lengths - 1
    out = prefill_attention(
        q, kv.k_pages, kv.v_pages, kv.page_indices, q_start, kv.lengths, backend="gpu", interpret=True
    )
    dec = paged_attention_reference(q[:, 0], kv.k_pages, kv.v_pages, kv.lengths, kv.page_indices)
    np.testing.assert_allclose(np.asarray(out[:, 0]), np.asarray(dec), atol=1e-5, rtol=1e-5)


# (backend, dtype, page_size, sliding_window, logit_softcap, pool layout). Contexts of 1, a page -1/0/+1
# and 6 pages (``chunk_layout``, chunks of up to 20 tokens: two query blocks of 16), so each window is also
# wider than the shorter contexts.
VARIANTS = [
    ("tpu", jnp.float32, 32, 5, 5.0, "lane-dense"),  # a window inside a page
    ("tpu", jnp.bfloat16, 16, 40, 5.0, "stacked"),  # a window over several pages
    ("gpu", jnp.float32, 16, 20, 5.0, "stacked"),
]
VARIANT_IDS = [f"{b}-{d.__name__}-ps{ps}-w{w}-cap{c}-{lay}" for b, d, ps, w, c, lay in VARIANTS]
VARIANT_SM_SCALE = 0.5  # scores of std ~4 at head_dim 64: the cap 5 changes them


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_sliding_window_and_softcap_match_naive_attention(variant, rng, make_kv, naive, tol):
    """Pages wholly before the window of a chunk's first token (before its block for the GPU variant) are
    NaN: never read."""
    backend, dtype, page_size, window, cap, layout = variant
    q, kv, q_start = make_inputs(rng, make_kv, dtype, page_size, 4, 1, 64, 6, 20)
    first_pages = [first_read_page(int(p), window, page_size, backend, 2) for p in np.asarray(q_start)]
    (k_pool, layer), (v_pool, _) = (pool_at_layer(x, layout) for x in poison_pages_before(kv, first_pages))
    variants = dict(sm_scale=VARIANT_SM_SCALE, sliding_window=window, logit_softcap=cap)
    out = prefill_attention(
        q, k_pool, v_pool, kv.page_indices, q_start, kv.lengths, layer=layer, backend=backend, interpret=True,
        block_q=16, pages_per_compute_block=2, **variants,
    )
    ref = prefill_attention_reference(q, kv.k_pages, kv.v_pages, kv.page_indices, q_start, kv.lengths, **variants)
    q64 = np.asarray(q.astype(jnp.float32), np.float64)

    def naive_chunks(window, cap):
        want = np.zeros(q.shape)
        for s, n in enumerate(real_rows(q_start, kv.lengths)):
            positions = int(q_start[s]) + np.arange(n)
            want[s, :n] = naive(q64[s, :n], kv.k_dense[s], kv.v_dense[s], positions, VARIANT_SM_SCALE, window, cap)
        return want

    want = naive_chunks(window, cap)
    for got in (out, ref):
        assert_close_on_real_rows(got, want, q_start, kv.lengths, tol(dtype))
    for without_one in (naive_chunks(None, cap), naive_chunks(window, None)):  # each changes the result
        assert np.abs(want - without_one).max() > 0.1


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_a_traced_window_gives_each_windows_result_from_one_program(backend, rng, make_kv, tol):
    """The layer's own window as an operand (0: none), on a stacked pool read at a layer: what the static window
    gives, and pages wholly before a chunk's window (before its block for the GPU variant) never read."""
    q, kv, q_start = make_inputs(rng, make_kv, jnp.float32, 16, 4, 1, 64, 6, 20)
    first_pages = [first_read_page(int(p), 20, 16, backend, 2) for p in np.asarray(q_start)]
    (k_pool, layer), (v_pool, _) = (pool_at_layer(x, "stacked") for x in poison_pages_before(kv, first_pages))
    (k_full, _), (v_full, _) = (pool_at_layer(x, "stacked") for x in (kv.k_pages, kv.v_pages))
    run = jax.jit(lambda k, v, window: prefill_attention(
        q, k, v, kv.page_indices, q_start, kv.lengths, layer=layer, backend=backend, interpret=True, block_q=16,
        pages_per_compute_block=2, sliding_window=window))
    outs = {}
    for window, k, v in ((20, k_pool, v_pool), (0, k_full, v_full)):
        outs[window] = run(k, v, jnp.int32(window))
        want = prefill_attention_reference(q, kv.k_pages, kv.v_pages, kv.page_indices, q_start, kv.lengths,
                                           sliding_window=window or None)
        assert_close_on_real_rows(outs[window], want, q_start, kv.lengths, tol(jnp.float32))
    assert run._cache_size() == 1
    assert np.abs(np.asarray(outs[20]) - np.asarray(outs[0])).max() > 0.1


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_sinks_add_a_logit_per_head_to_each_softmax_denominator(backend, rng, make_kv, naive, tol):
    """gpt-oss's attention sinks (GQA 9:3: a group of 3 heads, padded to 4 on the GPU), with a window: the naive
    softmax with exp(sink) more in each head's denominator."""
    q, kv, q_start = make_inputs(rng, make_kv, jnp.float32, 16, 9, 3, 64, 6, 20)
    sinks = rng.normal(0.0, 1.0, 9).astype(np.float32)
    out = prefill_attention(q, kv.k_pages, kv.v_pages, kv.page_indices, q_start, kv.lengths, backend=backend,
                            interpret=True, block_q=16, pages_per_compute_block=2, sm_scale=0.125, sliding_window=20,
                            sinks=jnp.asarray(sinks))
    q64 = np.asarray(q, np.float64)

    def naive_chunks(sinks):
        want = np.zeros(q.shape)
        for s, n in enumerate(real_rows(q_start, kv.lengths)):
            positions = int(q_start[s]) + np.arange(n)
            want[s, :n] = naive(q64[s, :n], kv.k_dense[s], kv.v_dense[s], positions, 0.125, 20, None, sinks)
        return want

    want = naive_chunks(sinks)
    assert_close_on_real_rows(out, want, q_start, kv.lengths, tol(jnp.float32))
    assert np.abs(want - naive_chunks(None)).max() > 0.05


@lowering_variants(num_q_heads=9)
@LOWERING_PLATFORMS
@LOWERING_DTYPES
def test_lowers_for_real_hardware(kernel_backend, platform, dtype, pool_dtype, variants):
    """Runs the Mosaic / Triton lowering (no device needed) so unsupported ops fail here, not on hardware; a
    float8 pool (the float8 KV cache) and an int8 pool with its scales (the int8 KV cache) under a bfloat16
    query too."""
    if pool_dtype == jnp.int8:
        scales = jax.ShapeDtypeStruct((3, 40, 16), jnp.float32)
        variants = variants | dict(k_scales=scales, v_scales=scales)
    args = (
        jax.ShapeDtypeStruct((2, 200, 9, 64), dtype),
        jax.ShapeDtypeStruct((3, 40, 16, 64), pool_dtype),
        jax.ShapeDtypeStruct((3, 40, 16, 64), pool_dtype),
        jax.ShapeDtypeStruct((2, 20), jnp.int32),
        jax.ShapeDtypeStruct((2,), jnp.int32),
        jax.ShapeDtypeStruct((2,), jnp.int32),
    )
    traced = prefill_attention.trace(*args, backend=kernel_backend, **variants)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert ("tpu_custom_call" if platform == "tpu" else "triton") in text


# ----------------------------------------------------------------------------------------- validation


def valid_args():
    pages = jnp.zeros((2, 6, 16, 64), jnp.float32)
    ones = jnp.ones((2,), jnp.int32)
    return dict(
        q=jnp.zeros((2, 5, 4, 64), jnp.float32),
        k_pages=pages,
        v_pages=pages,
        page_indices=jnp.zeros((2, 3), jnp.int32),
        q_start=ones,
        lengths=ones,
    )


BAD_INPUTS = [
    (
        {"q": jnp.zeros((2, 4, 64))},
        r"q must be \[num_seqs, chunk_len, num_q_heads, head_dim\], got shape \(2, 4, 64\)",
    ),
    ({"q": jnp.zeros((2, 5, 3, 64))}, r"num_q_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
    (
        {"q": jnp.zeros((2, 5, 4, 64), jnp.bfloat16)},
        r"q dtype \(bfloat16\) must match the k_pages/v_pages dtype",
    ),
    ({"q": jnp.zeros((2, 5, 4, 32))}, r"q head_dim \(32\) must match the k_pages head_dim \(64\)"),
    (
        {"k_pages": jnp.zeros((2, 6, 16, 48)), "v_pages": jnp.zeros((2, 6, 16, 48))},
        r"head_dim must be one of \(64, 128, 256\), got 48",
    ),
    (
        {"k_pages": jnp.zeros((2, 6, 256, 64)), "v_pages": jnp.zeros((2, 6, 256, 64))},
        r"page_size must be one of \(16, 32, 64, 128\), got 256",
    ),
    ({"v_pages": jnp.zeros((2, 6, 16, 64), jnp.bfloat16)}, r"k_pages and v_pages must have the same dtype"),
    (
        {"q_start": jnp.ones((2, 1), jnp.int32)},
        r"q_start must have shape \(num_seqs,\) = \(2,\), got \(2, 1\)",
    ),
    ({"q_start": jnp.ones((2,), jnp.float32)}, r"q_start must be int32, got float32"),
    ({"lengths": jnp.ones((1,), jnp.int32)}, r"lengths must have shape \(num_seqs,\) = \(2,\), got \(1,\)"),
    (
        {"page_indices": jnp.zeros((2,), jnp.int32)},
        r"page_indices must have shape \(num_seqs, pages_per_seq\)",
    ),
]


@pytest.mark.parametrize("change,message", BAD_INPUTS)
def test_rejects_bad_inputs(change, message):
    args = valid_args() | change
    with pytest.raises(ValueError, match=message):
        prefill_attention(**args, backend="tpu", interpret=True)
    with pytest.raises(ValueError, match=message):
        prefill_attention_reference(**args)


@pytest.mark.parametrize(
    "knobs,message",
    [
        ({"block_q": 8}, r"block_q must be a power of two >= 16, got 8"),
        ({"block_q": 48}, r"block_q must be a power of two >= 16, got 48"),
        ({"pages_per_compute_block": 0}, r"pages_per_compute_block must be a power of two >= 1, got 0"),
        ({"num_warps": 4}, r"num_warps is a knob of the other backend; it is not used by backend='tpu'"),
        ({"sliding_window": True}, r"sliding_window must be an int >= 1 \(None or 0: no window\), got True"),
        ({"logit_softcap": float("nan")}, r"logit_softcap must be finite and > 0 \(None or 0: no soft-cap\)"),
    ],
)
def test_rejects_bad_knobs(knobs, message):
    with pytest.raises(ValueError, match=message):
        prefill_attention(**valid_args(), backend="tpu", interpret=True, **knobs)
