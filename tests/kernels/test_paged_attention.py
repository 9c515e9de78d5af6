"""Decode kernel (both Pallas variants, interpret mode on CPU) against the jnp reference, and the reference
against a naive numpy attention; with a sliding window and logit soft-cap, kernel and reference against the
naive attention (pages before the window NaN; stacked pools, plain and lane-dense, read at a layer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention import paged_attention, paged_attention_reference
from tests.kernels.conftest import (
    LOWERING_DTYPES,
    LOWERING_PLATFORMS,
    first_read_page,
    lowering_variants,
    poison_pages_before,
    pool_at_layer,
)

# (dtype, page_size, num_q_heads, num_kv_heads, head_dim, pages_per_seq, gpu num_splits)
CASES = [
    (jnp.float32, 16, 4, 4, 64, 3, 1),  # MHA
    (jnp.bfloat16, 16, 8, 2, 128, 3, 2),  # GQA 4:1
    (jnp.float32, 32, 9, 3, 128, 3, None),  # GQA 3:1
    (jnp.bfloat16, 32, 4, 4, 64, 3, 3),
    (jnp.float32, 128, 8, 2, 64, 2, 2),
    (jnp.bfloat16, 128, 9, 3, 64, 2, None),
]
CASE_IDS = [f"{d.__name__}-ps{ps}-{qh}q{kh}kv-d{hd}" for d, ps, qh, kh, hd, _, _ in CASES]


def edge_lengths(page_size, pages_per_seq):
    """1, one short of a page, a page, one past a page, and the full block table."""
    return [1, page_size - 1, page_size, page_size + 1, page_size * pages_per_seq]


def make_inputs(rng, make_kv, dtype, page_size, num_q_heads, num_kv_heads, head_dim, pages_per_seq, lengths):
    kv = make_kv(
        rng,
        lengths=lengths,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        dtype=dtype,
    )
    q = jnp.asarray(rng.standard_normal((len(lengths), num_q_heads, head_dim)), dtype)
    return q, kv


def assert_close(out, ref, dtype, tol):
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, ref, atol=tol(dtype), rtol=tol(dtype))


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_kernel_matches_reference(case, backend, rng, make_kv, tol):
    dtype, page_size, num_q_heads, num_kv_heads, head_dim, pages_per_seq, num_splits = case
    lengths = edge_lengths(page_size, pages_per_seq)
    q, kv = make_inputs(
        rng, make_kv, dtype, page_size, num_q_heads, num_kv_heads, head_dim, pages_per_seq, lengths
    )
    knobs = {"pages_per_compute_block": 2}
    if backend == "gpu":
        knobs["num_splits"] = num_splits
    out = paged_attention(
        q, kv.k_pages, kv.v_pages, kv.lengths, kv.page_indices, backend=backend, interpret=True, **knobs
    )
    ref = paged_attention_reference(q, kv.k_pages, kv.v_pages, kv.lengths, kv.page_indices)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, dtype, tol)


@pytest.mark.parametrize(
    "backend,knobs",
    [
        ("tpu", {}),  # tuned-table defaults
        ("tpu", {"pages_per_compute_block": 1}),
        ("tpu", {"pages_per_compute_block": 4}),
        ("gpu", {}),
        ("gpu", {"pages_per_compute_block": 1, "num_splits": 5}),
        ("gpu", {"pages_per_compute_block": 4, "num_splits": 2}),
    ],
)
def test_tuning_knobs(backend, knobs, rng, make_kv, tol):
    lengths = [5, 16, 33, 80]
    q, kv = make_inputs(rng, make_kv, jnp.float32, 16, 6, 2, 64, 5, lengths)
    out = paged_attention(
        q,
        kv.k_pages,
        kv.v_pages,
        kv.lengths,
        kv.page_indices,
        backend=backend,
        interpret=True,
        sm_scale=0.3,
        **knobs,
    )
    ref = paged_attention_reference(q, kv.k_pages, kv.v_pages, kv.lengths, kv.page_indices, sm_scale=0.3)
    assert_close(out, ref, jnp.float32, tol)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_zero_length_sequence_gives_zeros(backend, rng, make_kv):
    q, kv = make_inputs(rng, make_kv, jnp.float32, 16, 4, 2, 64, 2, [3, 20])
    lengths = kv.lengths.at[0].set(0)
    out = paged_attention(
        q, kv.k_pages, kv.v_pages, lengths, kv.page_indices, backend=backend, interpret=True
    )
    ref = paged_attention_reference(q, kv.k_pages, kv.v_pages, lengths, kv.page_indices)
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_block_table_padding_is_never_dereferenced(backend, rng, make_kv, tol):
    """Entries past a sequence's length may hold anything, even out-of-range page numbers."""
    q, kv = make_inputs(rng, make_kv, jnp.float32, 16, 4, 2, 64, 4, [1, 17, 40])
    used = (np.asarray(kv.lengths)[:, None] + 15) // 16
    garbage = np.where(np.arange(4)[None, :] < used, np.asarray(kv.page_indices), [[-7], [10**6], [-1]])
    table = jnp.asarray(garbage, jnp.int32)
    out = paged_attention(q, kv.k_pages, kv.v_pages, kv.lengths, table, backend=backend, interpret=True)
    ref = paged_attention_reference(q, kv.k_pages, kv.v_pages, kv.lengths, kv.page_indices)
    assert_close(out, ref, jnp.float32, tol)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_head_dim_256(backend, rng, make_kv, tol):
    q, kv = make_inputs(rng, make_kv, jnp.bfloat16, 32, 2, 1, 256, 2, [31, 64])
    args = (q, kv.k_pages, kv.v_pages, kv.lengths, kv.page_indices)
    out = paged_attention(*args, backend=backend, interpret=True)
    assert_close(out, paged_attention_reference(*args), jnp.bfloat16, tol)


def test_auto_backend_on_cpu(rng, make_kv):
    q, kv = make_inputs(rng, make_kv, jnp.float32, 16, 4, 2, 64, 2, [7, 32])
    args = (q, kv.k_pages, kv.v_pages, kv.lengths, kv.page_indices)
    auto = paged_attention(*args, interpret=True)
    tpu = paged_attention(*args, backend="tpu", interpret=True)
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(tpu))
    with pytest.raises(ValueError, match=r"backend='auto' found no accelerator \(platform 'cpu'\)"):
        paged_attention(*args)


def test_tpu_variant_has_no_dma_races(rng, make_kv):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # private: where jax records races
    from jax.experimental.pallas import tpu as pltpu

    q, kv = make_inputs(rng, make_kv, jnp.bfloat16, 16, 6, 2, 64, 4, [17, 64])
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")
    out = paged_attention(
        q,
        kv.k_pages,
        kv.v_pages,
        kv.lengths,
        kv.page_indices,
        backend="tpu",
        interpret=params,
        pages_per_compute_block=1,
    )
    out.block_until_ready()
    assert not interpret_pallas_call.races.races_found


@pytest.mark.parametrize("case", CASES[:3], ids=CASE_IDS[:3])
def test_reference_matches_naive_numpy(case, rng, make_kv, naive, tol):
    dtype, page_size, num_q_heads, num_kv_heads, head_dim, pages_per_seq, _ = case
    lengths = edge_lengths(page_size, pages_per_seq)
    q, kv = make_inputs(
        rng, make_kv, dtype, page_size, num_q_heads, num_kv_heads, head_dim, pages_per_seq, lengths
    )
    ref = np.asarray(
        paged_attention_reference(q, kv.k_pages, kv.v_pages, kv.lengths, kv.page_indices).astype(jnp.float32)
    )
    q64 = np.asarray(q.astype(jnp.float32), np.float64)
    for s, length in enumerate(lengths):
        want = naive(q64[s][None], kv.k_dense[s], kv.v_dense[s], [length - 1], 1 / np.sqrt(head_dim))
        np.testing.assert_allclose(ref[s], want[0], atol=tol(dtype), rtol=tol(dtype))


# (backend, dtype, page_size, sliding_window, logit_softcap, pool layout). With lengths 1, a page -1/0/+1
# and the full table of 6 pages, each window is also wider than the shorter contexts.
VARIANTS = [
    ("tpu", jnp.float32, 32, 5, 5.0, "lane-dense"),  # a window inside a page
    ("tpu", jnp.bfloat16, 16, 40, 5.0, "stacked"),  # a window over several pages
    ("gpu", jnp.float32, 16, 40, 5.0, "stacked"),  # 2 splits of 4 pages; the window from page 3 to 5
]
VARIANT_IDS = [f"{b}-{d.__name__}-ps{ps}-w{w}-cap{c}-{lay}" for b, d, ps, w, c, lay in VARIANTS]
VARIANT_SM_SCALE = 0.5  # scores of std ~4 at head_dim 64: the cap 5 changes them


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_sliding_window_and_softcap_match_naive_attention(variant, rng, make_kv, naive, tol):
    """Pages wholly before a query's window (before its block for the GPU variant) are NaN: never read."""
    backend, dtype, page_size, window, cap, layout = variant
    lengths = edge_lengths(page_size, 6)
    q, kv = make_inputs(rng, make_kv, dtype, page_size, 4, 1, 64, 6, lengths)
    first_pages = [first_read_page(n - 1, window, page_size, backend, 2) for n in lengths]
    (k_pool, layer), (v_pool, _) = (pool_at_layer(x, layout) for x in poison_pages_before(kv, first_pages))
    variants = dict(sm_scale=VARIANT_SM_SCALE, sliding_window=window, logit_softcap=cap)
    knobs = {"pages_per_compute_block": 2} | ({"num_splits": 2} if backend == "gpu" else {})
    out = paged_attention(
        q, k_pool, v_pool, kv.lengths, kv.page_indices, layer=layer, backend=backend, interpret=True, **knobs,
        **variants,
    )
    ref = paged_attention_reference(q, kv.k_pages, kv.v_pages, kv.lengths, kv.page_indices, **variants)
    q64 = np.asarray(q.astype(jnp.float32), np.float64)

    def naive_decode(window, cap):
        return np.stack([
            naive(q64[s][None], kv.k_dense[s], kv.v_dense[s], [n - 1], VARIANT_SM_SCALE, window, cap)[0]
            for s, n in enumerate(lengths)
        ])

    want = naive_decode(window, cap)
    assert_close(out, want, dtype, tol)
    assert_close(ref, want, dtype, tol)
    for without_one in (naive_decode(None, cap), naive_decode(window, None)):  # each changes the result
        assert np.abs(want - without_one).max() > 0.1


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_a_traced_window_gives_each_windows_result_from_one_program(backend, rng, make_kv, tol):
    """The layer's own window as an operand (0: none), on a stacked pool read at a layer: what the static window
    gives, and pages wholly before the window (before its block for the GPU variant) never read."""
    lengths = edge_lengths(16, 6)
    q, kv = make_inputs(rng, make_kv, jnp.float32, 16, 4, 1, 64, 6, lengths)
    first_pages = [first_read_page(n - 1, 5, 16, backend, 2) for n in lengths]
    (k_pool, layer), (v_pool, _) = (pool_at_layer(x, "stacked") for x in poison_pages_before(kv, first_pages))
    (k_full, _), (v_full, _) = (pool_at_layer(x, "stacked") for x in (kv.k_pages, kv.v_pages))
    run = jax.jit(lambda k, v, window: paged_attention(
        q, k, v, kv.lengths, kv.page_indices, layer=layer, backend=backend, interpret=True,
        pages_per_compute_block=2, sliding_window=window))
    outs = {}
    for window, k, v in ((5, k_pool, v_pool), (40, k_full, v_full), (0, k_full, v_full)):
        outs[window] = run(k, v, jnp.int32(window))
        want = paged_attention_reference(q, kv.k_pages, kv.v_pages, kv.lengths, kv.page_indices,
                                         sliding_window=window or None)
        assert_close(outs[window], want, jnp.float32, tol)
    assert run._cache_size() == 1
    assert np.abs(np.asarray(outs[5]) - np.asarray(outs[0])).max() > 0.1


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_sinks_add_a_logit_per_head_to_each_softmax_denominator(backend, rng, make_kv, naive, tol):
    """gpt-oss's attention sinks (GQA 9:3, so each kv head's group has its own three), with a window: the naive
    softmax with exp(sink) more in each head's denominator (the GPU variant over 2 splits adds them as it
    combines the splits)."""
    lengths = edge_lengths(16, 6)
    q, kv = make_inputs(rng, make_kv, jnp.float32, 16, 9, 3, 64, 6, lengths)
    sinks = rng.normal(0.0, 1.0, 9).astype(np.float32)
    knobs = {"pages_per_compute_block": 2} | ({"num_splits": 2} if backend == "gpu" else {})
    out = paged_attention(q, kv.k_pages, kv.v_pages, kv.lengths, kv.page_indices, backend=backend, interpret=True,
                          sm_scale=0.125, sliding_window=40, sinks=jnp.asarray(sinks), **knobs)
    q64 = np.asarray(q, np.float64)

    def naive_decode(sinks):
        return np.stack([naive(q64[s][None], kv.k_dense[s], kv.v_dense[s], [n - 1], 0.125, 40, None, sinks)[0]
                         for s, n in enumerate(lengths)])

    want = naive_decode(sinks)
    assert_close(out, want, jnp.float32, tol)
    assert np.abs(want - naive_decode(None)).max() > 0.05


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
        jax.ShapeDtypeStruct((4, 9, 64), dtype),
        jax.ShapeDtypeStruct((3, 40, 16, 64), pool_dtype),
        jax.ShapeDtypeStruct((3, 40, 16, 64), pool_dtype),
        jax.ShapeDtypeStruct((4,), jnp.int32),
        jax.ShapeDtypeStruct((4, 8), jnp.int32),
    )
    traced = paged_attention.trace(*args, backend=kernel_backend, **variants)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert ("tpu_custom_call" if platform == "tpu" else "triton") in text


# ----------------------------------------------------------------------------------------- validation


def valid_args():
    q = jnp.zeros((2, 4, 64), jnp.float32)
    pages = jnp.zeros((2, 6, 16, 64), jnp.float32)
    return dict(
        q=q,
        k_pages=pages,
        v_pages=pages,
        lengths=jnp.ones((2,), jnp.int32),
        page_indices=jnp.zeros((2, 3), jnp.int32),
    )


BAD_INPUTS = [
    (
        {"q": jnp.zeros((2, 4, 1, 64))},
        r"q must be \[num_seqs, num_q_heads, head_dim\], got shape \(2, 4, 1, 64\)",
    ),
    ({"q": jnp.zeros((2, 3, 64))}, r"num_q_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
    (
        {"q": jnp.zeros((2, 4, 64), jnp.bfloat16)},
        r"q dtype \(bfloat16\) must match the k_pages/v_pages dtype",
    ),
    ({"q": jnp.zeros((2, 4, 128))}, r"q head_dim \(128\) must match the k_pages head_dim \(64\)"),
    ({"v_pages": jnp.zeros((2, 7, 16, 64))}, r"k_pages and v_pages must have the same shape"),
    (
        {
            "k_pages": jnp.zeros((2, 6, 16, 64), jnp.float16),
            "v_pages": jnp.zeros((2, 6, 16, 64), jnp.float16),
        },
        r"k_pages dtype must be float32, bfloat16, float8_e4m3fn or int8, got float16",
    ),
    (
        {"k_pages": jnp.zeros((2, 6, 8, 64)), "v_pages": jnp.zeros((2, 6, 8, 64))},
        r"page_size must be one of \(16, 32, 64, 128\), got 8",
    ),
    (
        {"k_pages": jnp.zeros((6, 16, 64)), "v_pages": jnp.zeros((6, 16, 64))},
        r"k_pages must be one layer \[num_kv_heads",
    ),
    ({"lengths": jnp.ones((3,), jnp.int32)}, r"lengths must have shape \(num_seqs,\) = \(2,\), got \(3,\)"),
    ({"lengths": jnp.ones((2,), jnp.float32)}, r"lengths must be int32, got float32"),
    (
        {"page_indices": jnp.zeros((3, 3), jnp.int32)},
        r"page_indices must have shape \(num_seqs, pages_per_seq\)",
    ),
    ({"page_indices": jnp.zeros((2, 3), jnp.float32)}, r"page_indices must be int32, got float32"),
]


@pytest.mark.parametrize("change,message", BAD_INPUTS)
def test_rejects_bad_inputs(change, message):
    args = valid_args() | change
    with pytest.raises(ValueError, match=message):
        paged_attention(**args, backend="gpu", interpret=True)
    with pytest.raises(ValueError, match=message):
        paged_attention_reference(**args)


@pytest.mark.parametrize(
    "knobs,message",
    [
        ({"backend": "cuda"}, r"backend must be one of \('auto', 'tpu', 'gpu'\), got 'cuda'"),
        ({"backend": "tpu", "pages_per_compute_block": 3}, r"pages_per_compute_block must be a power of two"),
        ({"backend": "tpu", "num_splits": 2}, r"num_splits is a knob of the other backend"),
        ({"backend": "gpu", "num_splits": 0}, r"num_splits must be >= 1, got 0"),
        ({"backend": "tpu", "sliding_window": -1}, r"sliding_window must be an int >= 1 \(None or 0: no window\)"),
        ({"backend": "gpu", "sliding_window": 2.5}, r"sliding_window must be an int >= 1 .*, got 2.5"),
        ({"backend": "tpu", "logit_softcap": -5.0}, r"logit_softcap must be finite and > 0 \(None or 0: no soft-cap\)"),
        ({"backend": "gpu", "logit_softcap": float("inf")}, r"logit_softcap must be finite and > 0 .*, got inf"),
    ],
)
def test_rejects_bad_knobs(knobs, message):
    with pytest.raises(ValueError, match=message):
        paged_attention(**valid_args(), interpret=True, **knobs)
    variants = {name: knobs[name] for name in ("sliding_window", "logit_softcap") if name in knobs}
    if variants:
        with pytest.raises(ValueError, match=message):
            paged_attention_reference(**valid_args(), **variants)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_zero_window_and_cap_are_off(backend):
    """0 means "no window" / "no cap" (as in kernels_cpu): the same program as None."""
    program = lambda **variants: str(jax.make_jaxpr(
        lambda *args: paged_attention(*args, backend=backend, interpret=True, **variants)
    )(*valid_args().values()))
    assert program(sliding_window=0, logit_softcap=0.0) == program()
    assert program(sliding_window=8) != program()


def test_a_traced_window_must_be_an_integer_scalar():
    for window in (jnp.float32(8.0), jnp.array([8, 8], jnp.int32)):
        with pytest.raises(ValueError, match=r"^a traced sliding_window must be an integer scalar, got "):
            paged_attention(**valid_args(), backend="tpu", interpret=True, sliding_window=window)
