"""The native XLA:CPU paged attention (`kernels_cpu`) against a naive numpy attention and the engine's
plain-XLA attention, on the stacked pool with shuffled pages, float32 and bfloat16 pools (every slot the
kernel must not read is NaN): decode rows, prefill chunks, and ragged batches mixing both (chunks of 0, 1,
page-edge and query-block-edge lengths, at page-edge positions, with and without a sliding window); logit
soft-capping (Gemma 2's c * tanh(score / c)) through the kernel and both backends, on scores well past the
cap; a float8 e4m3 pool stored as its bits (the engine's float8 KV cache); an int8 pool with per-token-per-head
scales (NaN scales in every slot it must not read) against the kernel on the float32 pool of its values; the pool
dtype, scale, soft-cap and row checks; the build's failure path; the backend choice.

Tolerance: rtol 2e-5, atol 2e-6 for both pool dtypes. A bfloat16 pool is compared with the naive attention
over the same bfloat16 values upcast (exactly) to float64, and the kernel computes in float32 on those
exact values, so its error is the float32 path's: about 5e-7 absolute at most on these cases. The soft-cap's
tanh is a rational approximation of a few ulp (as XLA:CPU's own), well inside the same tolerance at cap 5.
The int8 pool is held to the same tolerance against the float32 pool of int8 * scale (rounded to float32 as the
kernel rounds it when it loads a row; today the two outputs are equal bit for bit)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import kernels_cpu
from jaxserve.attention.backends import CpuBackend, ReferenceBackend, get_attention_backend
from jaxserve.attention.metadata import AttentionMetadata
from tests.kernels.conftest import naive_softmax

POOL_DTYPES = pytest.mark.parametrize("pool_dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])

# (num_q_heads, num_kv_heads, head_dim, block_size, pages_per_seq)
CASES = [(9, 3, 64, 16, 6), (4, 4, 32, 8, 5), (8, 2, 128, 32, 3), (16, 1, 64, 4, 9)]
NUM_LAYERS, NUM_BLOCKS, LAYER = 3, 64, 2


def _inputs(rng, num_q_heads, num_kv_heads, head_dim, block_size, pages_per_seq, pool_dtype=np.float32):
    capacity = block_size * pages_per_seq
    # lengths: 0 (a padding row), 1, one short of a page, a page, one past it, the full table, random
    lengths = np.array([0, 1, block_size - 1, block_size, block_size + 1, capacity, rng.integers(2, capacity)])
    pool_shape = (NUM_LAYERS, num_kv_heads, NUM_BLOCKS, block_size, head_dim)
    k_pool = rng.standard_normal(pool_shape).astype(pool_dtype)
    v_pool = rng.standard_normal(pool_shape).astype(pool_dtype)
    pages = rng.permutation(NUM_BLOCKS)[: len(lengths) * pages_per_seq]
    block_tables = pages.reshape(len(lengths), pages_per_seq).astype(np.int32)
    q = rng.standard_normal((len(lengths), num_q_heads, head_dim)).astype(np.float32)
    return q, k_pool, v_pool, block_tables, lengths.astype(np.int32)


def _decode(q, k_pool, v_pool, layer, block_tables, lengths, **kwargs):
    """One query token per row, the row's last: the kernel on a decode step's layout."""
    lengths = jnp.asarray(lengths, jnp.int32)
    return kernels_cpu.padded_paged_attention(q[:, None], k_pool, v_pool, layer, block_tables, lengths - 1, lengths,
                                              **kwargs)[:, 0]


def _decode_rows(lengths):
    """query_starts, query_lens, positions, lengths of a decode step: row s is token s, its sequence's last."""
    lengths = np.asarray(lengths, np.int32)
    return np.arange(len(lengths), dtype=np.int32), np.ones_like(lengths), lengths - 1, lengths


def _call_handler(q, k_pool, v_pool, block_tables, lengths, *scales, logit_softcap=0.0, window=0):
    """The FFI handler called directly on a decode step, around the wrapper's checks, run to completion."""
    call = jax.ffi.ffi_call(kernels_cpu.TARGET_NAME, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, k_pool, v_pool, np.array([LAYER], np.int32), block_tables, *_decode_rows(lengths),
                np.array([window], np.int32), np.zeros((0,), np.float32), *scales, sm_scale=np.float32(0.125),
                logit_softcap=np.float32(logit_softcap)).block_until_ready()


# Ragged rows (query tokens, position of the first, length seen): a decode row, padding, a chunk from 0 of
# one page and one query block (16), one past both, a chunk starting mid-page, one ending on a page edge, a
# long chunk over several query blocks, a row of 0 query tokens, tokens past the length (padding in a row).
RAGGED_ROWS = [(1, 40, 41), (1, -1, 0), (16, 0, 16), (17, 0, 17), (5, 13, 18), (9, 23, 32), (40, 7, 47),
               (0, 30, 30), (6, 20, 23)]


def _ragged_inputs(rng, num_q_heads, num_kv_heads, head_dim, block_size, pool_dtype):
    query_lens = np.array([n for n, _, _ in RAGGED_ROWS], np.int32)
    positions = np.array([pos for _, pos, _ in RAGGED_ROWS], np.int32)
    lengths = np.array([length for _, _, length in RAGGED_ROWS], np.int32)
    query_starts = np.concatenate([[3], 3 + np.cumsum(query_lens)[:-1]]).astype(np.int32)  # tokens 0-2 in no row
    num_tokens = int(query_starts[-1] + query_lens[-1] + 2)  # and two more at the end
    pages_per_seq = -(-int(lengths.max()) // block_size)
    pool_shape = (NUM_LAYERS, num_kv_heads, len(RAGGED_ROWS) * pages_per_seq + 4, block_size, head_dim)
    k_pool = rng.standard_normal(pool_shape).astype(pool_dtype)
    v_pool = rng.standard_normal(pool_shape).astype(pool_dtype)
    block_tables = rng.permutation(pool_shape[2])[: len(RAGGED_ROWS) * pages_per_seq]
    block_tables = block_tables.reshape(len(RAGGED_ROWS), pages_per_seq).astype(np.int32)
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32)
    return q, k_pool, v_pool, block_tables, (query_starts, query_lens, positions, lengths)


def _naive_ragged(q, k_pool, v_pool, block_tables, rows, sm_scale, window=None, softcap=None, sinks=None):
    """Token i of row s at position positions[s] + i sees positions (position - window, position]; with
    ``softcap`` c its scores s become c * tanh(s / c); with ``sinks``, head h's softmax has exp(sinks[h]) more in
    its denominator."""
    num_kv_heads, block_size = k_pool.shape[1], k_pool.shape[3]
    group = q.shape[1] // num_kv_heads
    out = np.zeros_like(q, dtype=np.float64)
    for s, (start, count, first, length) in enumerate(zip(*rows, strict=True)):
        for i in range(count):
            position = first + i
            if not 0 <= position < length:
                continue
            seen = np.arange(0 if window is None else max(0, position - window + 1), position + 1)
            blocks, slots = block_tables[s, seen // block_size], seen % block_size
            for h in range(q.shape[1]):
                keys = k_pool[LAYER, h // group, blocks, slots].astype(np.float64)
                values = v_pool[LAYER, h // group, blocks, slots].astype(np.float64)
                scores = keys @ q[start + i, h] * sm_scale
                if softcap:
                    scores = softcap * np.tanh(scores / softcap)
                out[start + i, h] = naive_softmax(scores, values, None if sinks is None else sinks[h])
    return out


def _poison_unseen(k_pool, v_pool, block_tables, rows, window=None):
    """NaN in every slot no token of any row sees: other layers, unused pages, the slots past each token's
    position and those before its window. A kernel that reads one of them (or lets a masked one through)
    returns NaN. The pools may be [L, Hkv, NB, BS, D] pages or an int8 pool's [L, Hkv, NB, BS] scales."""
    block_size = k_pool.shape[3]
    seen = np.zeros((k_pool.shape[0], k_pool.shape[2], block_size), bool)
    for s, (_, count, first, length) in enumerate(zip(*rows, strict=True)):
        for position in range(max(first, 0), min(first + count, length)):
            positions = np.arange(0 if window is None else max(0, position - window + 1), position + 1)
            seen[LAYER, block_tables[s, positions // block_size], positions % block_size] = True
    for pool in (k_pool, v_pool):
        np.moveaxis(pool, 1, 3)[~seen] = np.nan


@pytest.mark.parametrize("case", CASES[:3], ids=[f"{c[0]}q{c[1]}kv-d{c[2]}-bs{c[3]}" for c in CASES[:3]])
@pytest.mark.parametrize("window", [None, 5, 20])
@POOL_DTYPES
def test_ragged_rows_of_decode_tokens_and_prefill_chunks_match_naive_attention(case, window, pool_dtype):
    assert kernels_cpu.load() is not None, kernels_cpu.build_error()
    num_q_heads, num_kv_heads, head_dim, block_size, _ = case
    q, k_pool, v_pool, block_tables, rows = _ragged_inputs(
        np.random.default_rng(sum(case)), num_q_heads, num_kv_heads, head_dim, block_size, pool_dtype)
    _poison_unseen(k_pool, v_pool, block_tables, rows, window)
    sm_scale = head_dim ** -0.5
    out = jax.jit(lambda *args: kernels_cpu.paged_attention(*args, sm_scale=sm_scale, sliding_window=window))(
        q, k_pool, v_pool, jnp.int32(LAYER), block_tables, *rows)
    expected = _naive_ragged(q, k_pool, v_pool, block_tables, rows, sm_scale, window)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-6)
    query_starts, query_lens, positions, lengths = rows
    answered = np.zeros(len(q), bool)  # tokens of a row at a position in [0, length)
    for start, count, first, length in zip(*rows, strict=True):
        answered[start : start + count] = (first + np.arange(count) >= 0) & (first + np.arange(count) < length)
    assert answered.sum() == 1 + 16 + 17 + 5 + 9 + 40 + 3
    assert not np.asarray(out)[~answered].any()  # tokens in no row, padding rows and padding tokens: zeros


def test_rows_whose_tokens_lie_outside_q_are_refused():
    assert kernels_cpu.load() is not None, kernels_cpu.build_error()
    q, k_pool, v_pool, block_tables, rows = _ragged_inputs(np.random.default_rng(1), 9, 3, 64, 16, np.float32)
    query_starts, query_lens, positions, lengths = rows
    for starts, lens in ((query_starts, query_lens + 3), (query_starts - 4, query_lens), (query_starts, -query_lens)):
        # XLA reports the handler's INVALID_ARGUMENT as a JaxRuntimeError or, on some dispatch paths, a ValueError
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match="a row's query tokens lie outside q"):
            kernels_cpu.paged_attention(q, k_pool, v_pool, jnp.int32(LAYER), block_tables, starts, lens, positions,
                                        lengths, sm_scale=0.125).block_until_ready()


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}q{c[1]}kv-d{c[2]}-bs{c[3]}" for c in CASES])
@pytest.mark.parametrize("window", [None, 5])
@POOL_DTYPES
def test_decode_rows_match_naive_attention(case, window, pool_dtype):
    assert kernels_cpu.load() is not None, kernels_cpu.build_error()
    q, k_pool, v_pool, block_tables, lengths = _inputs(np.random.default_rng(sum(case)), *case, pool_dtype)
    rows = _decode_rows(lengths)
    _poison_unseen(k_pool, v_pool, block_tables, rows, window)
    sm_scale = case[2] ** -0.5
    run = jax.jit(lambda *args: _decode(*args, sm_scale=sm_scale, sliding_window=window))
    out = run(q, k_pool, v_pool, jnp.int32(LAYER), block_tables, lengths)
    np.testing.assert_allclose(np.asarray(out), _naive_ragged(q, k_pool, v_pool, block_tables, rows, sm_scale, window),
                               rtol=2e-5, atol=2e-6)
    assert not np.asarray(out)[0].any()  # the padding row (length 0) is zeros


@POOL_DTYPES
def test_cpu_backend_equals_the_plain_xla_backend_on_decode_and_prefill(pool_dtype):
    rng = np.random.default_rng(7)
    q, k_pool, v_pool, block_tables, lengths = _inputs(rng, 9, 3, 64, 16, 6, pool_dtype)
    _poison_unseen(k_pool, v_pool, block_tables, _decode_rows(lengths))
    meta = AttentionMetadata(block_tables=jnp.asarray(block_tables), q_start=jnp.asarray(np.maximum(lengths - 1, 0)),
                             lengths=jnp.asarray(lengths))
    attend = lambda backend, q, meta: jax.jit(
        lambda q, k, v, meta: backend.attend(q, k, v, jnp.int32(LAYER), meta, sm_scale=0.125)
    )(q, k_pool, v_pool, meta)
    decode_q = jnp.asarray(q[:, None])
    np.testing.assert_allclose(attend(CpuBackend(), decode_q, meta), attend(ReferenceBackend(), decode_q, meta),
                               rtol=2e-5, atol=2e-6)
    # Prefill chunks of 20 query tokens ending at each length (rows shorter than 20 start at 0 and pad the rest)
    chunk_meta = AttentionMetadata(block_tables=meta.block_tables, q_start=jnp.maximum(meta.lengths - 20, 0),
                                   lengths=meta.lengths)
    chunk_q = jnp.asarray(rng.standard_normal((len(lengths), 20, 9, 64)).astype(np.float32))
    np.testing.assert_allclose(attend(CpuBackend(), chunk_q, chunk_meta),
                               attend(ReferenceBackend(), chunk_q, chunk_meta), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("num_q_heads,head_dim", [(32, 64), (4, 576)], ids=["group-32", "head-dim-576"])
def test_heads_the_kernel_does_not_take_attend_in_plain_xla(num_q_heads, head_dim):
    """More query heads per kv head than the kernel's MAX_GROUP (DeepSeek-V3's 128 heads over its one latent) or a
    head_dim over its MAX_HEAD_DIM (the latent's 576): the backend attends as the plain-XLA one does (the kernel would
    refuse them)."""
    rng = np.random.default_rng(3)
    q, k_pool, v_pool, block_tables, lengths = _inputs(rng, num_q_heads, 1, head_dim, 16, 2)
    k_pool, v_pool = jnp.asarray(k_pool), jnp.asarray(v_pool)
    meta = AttentionMetadata(block_tables=jnp.asarray(block_tables), q_start=jnp.asarray(np.maximum(lengths - 1, 0)),
                             lengths=jnp.asarray(lengths))
    outs = [backend.attend(jnp.asarray(q[:, None]), k_pool, v_pool, jnp.int32(LAYER), meta, sm_scale=0.1)
            for backend in (CpuBackend(), ReferenceBackend())]
    np.testing.assert_array_equal(*outs)
    with pytest.raises(Exception, match="unsupported head layout for the CPU paged attention"):
        kernels_cpu.padded_paged_attention(jnp.asarray(q[:, None]), k_pool, v_pool, jnp.int32(LAYER),
                                           meta.block_tables, meta.q_start, meta.lengths, sm_scale=0.1)


def test_a_bfloat16_pool_stored_as_its_bits_reads_the_same_values():
    """The engine stores a bf16 pool as uint16 on CPU (kv_cache.kv_storage_dtype): the kernel and the plain-XLA
    path read those bits as the bf16 values, bit for bit."""
    rng = np.random.default_rng(11)
    q, k_pool, v_pool, block_tables, lengths = _inputs(rng, 9, 3, 64, 16, 6, jnp.bfloat16)
    _poison_unseen(k_pool, v_pool, block_tables, _decode_rows(lengths))
    bits = k_pool.view(np.uint16), v_pool.view(np.uint16)
    meta = AttentionMetadata(block_tables=jnp.asarray(block_tables), q_start=jnp.asarray(np.maximum(lengths - 4, 0)),
                             lengths=jnp.asarray(lengths))
    decode_meta = meta.replace(q_start=jnp.asarray(np.maximum(lengths - 1, 0)))
    chunk_q = jnp.asarray(rng.standard_normal((len(lengths), 4, 9, 64)).astype(np.float32))
    calls = ((CpuBackend(), jnp.asarray(q[:, None]), decode_meta), (CpuBackend(), chunk_q, meta),
             (ReferenceBackend(), chunk_q, meta))
    for backend, step_q, step_meta in calls:
        attend = jax.jit(lambda q, k, v, meta, b=backend: b.attend(q, k, v, jnp.int32(LAYER), meta, sm_scale=0.125))
        out = attend(step_q, *bits, step_meta)
        assert not np.isnan(np.asarray(out)).any()
        np.testing.assert_array_equal(out, attend(step_q, k_pool, v_pool, step_meta))


def test_a_float8_pool_stored_as_its_bits_matches_naive_attention_over_its_values():
    """The float8 KV cache on CPU is e4m3 stored as uint8 (kv_cache.kv_storage_dtype): the kernel widens each
    element exactly (NaN included: every unseen slot is NaN), on ragged rows of decode tokens and chunks."""
    rng = np.random.default_rng(13)
    q, k_pool, v_pool, block_tables, rows = _ragged_inputs(rng, 9, 3, 64, 16, ml_dtypes.float8_e4m3fn)
    _poison_unseen(k_pool, v_pool, block_tables, rows)
    bits = k_pool.view(np.uint8), v_pool.view(np.uint8)
    out = jax.jit(lambda *args: kernels_cpu.paged_attention(*args, sm_scale=0.125))(
        q, *bits, jnp.int32(LAYER), block_tables, *rows)
    expected = _naive_ragged(q, k_pool.astype(np.float32), v_pool.astype(np.float32), block_tables, rows, 0.125)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-6)
    assert np.abs(expected).max() > 0.5  # the values are read (not zeros)


def test_auto_picks_the_cpu_kernel_and_a_failed_build_reports_why(monkeypatch, tmp_path):
    assert get_attention_backend("auto").name == "cpu"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")  # a compiler that fails: another library path, a failed build
    assert kernels_cpu.load.__wrapped__() is None
    assert kernels_cpu.build_error().startswith("/bin/false -O3 -march=native")
    assert kernels_cpu.build_error().endswith("failed:\n")
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built is left to be loaded later
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert kernels_cpu.load.__wrapped__() is None and "failed" not in kernels_cpu.build_error()


@POOL_DTYPES
def test_out_of_range_block_ids_are_clamped_like_xla_gathers(pool_dtype):
    q, k_pool, v_pool, block_tables, lengths = _inputs(np.random.default_rng(3), 9, 3, 64, 16, 6, pool_dtype)
    bad = block_tables.copy()
    bad[5, 0], bad[6, 1] = NUM_BLOCKS + 7, -3
    clamped = np.clip(bad, 0, NUM_BLOCKS - 1)
    rows = _decode_rows(lengths)
    _poison_unseen(k_pool, v_pool, clamped, rows)
    run = jax.jit(lambda tables: _decode(q, k_pool, v_pool, jnp.int32(LAYER), tables, lengths, sm_scale=0.125))
    np.testing.assert_array_equal(run(bad), run(clamped))
    np.testing.assert_allclose(run(bad), _naive_ragged(q, k_pool, v_pool, clamped, rows, 0.125), rtol=2e-5, atol=2e-6)


def test_other_pool_dtypes_are_refused_with_a_clear_error():
    assert kernels_cpu.load() is not None, kernels_cpu.build_error()
    q, k_pool, v_pool, block_tables, lengths = _inputs(np.random.default_rng(5), 4, 4, 32, 8, 5)
    args = lambda k, v: (q, k, v, jnp.int32(LAYER), block_tables, lengths)
    half = jnp.asarray(k_pool, jnp.float16), jnp.asarray(v_pool, jnp.float16)
    mixed = k_pool, v_pool.astype(jnp.bfloat16)
    for k, v in (half, mixed):  # the wrapper refuses them before the call...
        with pytest.raises(ValueError, match=r"reads float32, bfloat16 \(or uint16 bits of bfloat16\), uint8 bits "
                           r"of float8 e4m3 or int8 \(with scales\) KV pools \(both the same dtype\), not k_pool"):
            _decode(*args(k, v), sm_scale=0.125)
    # ... and so does the FFI handler, for a caller that goes around the wrapper
    for k, v in (half, mixed):
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=r"the KV pools must both be float32, bfloat16 \(or its uint16 bits\), float8 "
                           r"e4m3 bits \(uint8\) or int8"):
            _call_handler(q, k, v, block_tables, lengths)
    # The cpu backend sends a float16 pool to the plain-XLA path instead.
    meta = AttentionMetadata(jnp.asarray(block_tables), jnp.asarray(np.maximum(lengths - 1, 0)), jnp.asarray(lengths))
    decode_q = jnp.asarray(q[:, None])
    np.testing.assert_array_equal(CpuBackend().attend(decode_q, *half, jnp.int32(LAYER), meta, sm_scale=0.125),
                                  ReferenceBackend().attend(decode_q, *half, jnp.int32(LAYER), meta, sm_scale=0.125))


# Soft-capping: q is scaled so that the scores (std 8) lie well past the cap, where it changes the result.
SOFTCAP, SOFTCAP_Q_SCALE = 5.0, 8.0


def _assert_the_cap_matters(expected, rows, q, k_pool, v_pool, block_tables, sm_scale, window):
    uncapped = _naive_ragged(q, k_pool, v_pool, block_tables, rows, sm_scale, window)
    assert np.abs(expected - uncapped).max() > 0.5


@pytest.mark.parametrize("window", [None, 5])
@POOL_DTYPES
def test_soft_capped_ragged_rows_match_naive_attention(window, pool_dtype):
    assert kernels_cpu.load() is not None, kernels_cpu.build_error()
    q, k_pool, v_pool, block_tables, rows = _ragged_inputs(np.random.default_rng(13), 9, 3, 64, 16, pool_dtype)
    q *= SOFTCAP_Q_SCALE
    _poison_unseen(k_pool, v_pool, block_tables, rows, window)
    sm_scale = 64 ** -0.5
    attend = jax.jit(lambda *args: kernels_cpu.paged_attention(
        *args, sm_scale=sm_scale, sliding_window=window, logit_softcap=SOFTCAP))
    out = np.asarray(attend(q, k_pool, v_pool, jnp.int32(LAYER), block_tables, *rows))
    expected = _naive_ragged(q, k_pool, v_pool, block_tables, rows, sm_scale, window, SOFTCAP)
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-6)
    _assert_the_cap_matters(expected, rows, q, k_pool, v_pool, block_tables, sm_scale, window)


def _padded_rows(q_start, lengths, num_query):
    """query_starts, query_lens, positions, lengths of a padded [S, num_query] step, flattened."""
    num_rows = len(lengths)
    return (np.arange(num_rows, dtype=np.int32) * num_query, np.full(num_rows, num_query, np.int32),
            np.asarray(q_start, np.int32), np.asarray(lengths, np.int32))


def _step_layouts(rng, lengths, block_tables, num_q_heads, head_dim):
    """(q, meta, rows) of three steps ending at each sequence's length: a decode step, a padded prefill chunk
    of 20 tokens and a ragged step of each sequence's last 4 tokens; q scaled past the soft-cap."""
    tables = jnp.asarray(block_tables)
    layouts = []
    for num_query in (1, 20):
        q_start = np.maximum(lengths - num_query, 0).astype(np.int32)
        q = rng.standard_normal((len(lengths), num_query, num_q_heads, head_dim)).astype(np.float32)
        meta = AttentionMetadata(tables, jnp.asarray(q_start), jnp.asarray(lengths))
        layouts.append((q * SOFTCAP_Q_SCALE, meta, _padded_rows(q_start, lengths, num_query)))
    q_start = np.maximum(lengths - 4, 0).astype(np.int32)
    query_lens = (lengths - q_start).astype(np.int32)
    query_starts = np.concatenate([[0], np.cumsum(query_lens)[:-1]]).astype(np.int32)
    q = rng.standard_normal((1, int(query_lens.sum()), num_q_heads, head_dim)).astype(np.float32)
    meta = AttentionMetadata(tables, jnp.asarray(q_start), jnp.asarray(lengths), jnp.asarray(query_starts))
    layouts.append((q * SOFTCAP_Q_SCALE, meta, (query_starts, query_lens, q_start, lengths)))
    return layouts


@pytest.mark.parametrize(("pool_dtype", "window"), [(np.float32, None), (jnp.bfloat16, 5)], ids=["f32", "bf16-window5"])
def test_soft_capped_cpu_and_plain_xla_backends_match_naive_attention(pool_dtype, window):
    """Decode, padded prefill and ragged steps through both backends' `attend`, with the soft-cap."""
    rng = np.random.default_rng(17)
    _, k_pool, v_pool, block_tables, lengths = _inputs(rng, 9, 3, 64, 16, 6, pool_dtype)
    layouts = _step_layouts(rng, lengths, block_tables, 9, 64)
    # NaN past what the chunks see (all the others see): not before the window, where plain XLA weights the
    # values by an exact 0 (finite in a real pool), which a NaN would turn into NaN
    _poison_unseen(k_pool, v_pool, block_tables, layouts[1][2])
    for backend in (CpuBackend(), ReferenceBackend()):
        attend = jax.jit(lambda q, k, v, meta, b=backend: b.attend(
            q, k, v, jnp.int32(LAYER), meta, sm_scale=0.125, sliding_window=window, logit_softcap=SOFTCAP))
        for q, meta, rows in layouts:
            flat_q = q.reshape(-1, *q.shape[2:])
            expected = _naive_ragged(flat_q, k_pool, v_pool, block_tables, rows, 0.125, window, SOFTCAP)
            out = np.asarray(attend(jnp.asarray(q), k_pool, v_pool, meta)).reshape(flat_q.shape)
            np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-6, err_msg=f"{backend.name} {q.shape}")
    _assert_the_cap_matters(expected, rows, flat_q, k_pool, v_pool, block_tables, 0.125, window)


def test_a_traced_window_gives_one_compiled_call_each_layers_own_window():
    """The window is an operand: one executable serves windows 5 and 20 and none (0), in the kernel and in the
    plain-XLA backend alike, each equal to naive attention with that window."""
    assert kernels_cpu.load() is not None, kernels_cpu.build_error()
    rng = np.random.default_rng(23)
    _, k_pool, v_pool, block_tables, lengths = _inputs(rng, 9, 3, 64, 16, 6, np.float32)
    q, meta, rows = _step_layouts(rng, lengths, block_tables, 9, 64)[2]  # a ragged step of decode rows and chunks
    flat_q = q.reshape(-1, *q.shape[2:])
    for backend in (CpuBackend(), ReferenceBackend()):
        attend = jax.jit(lambda q, k, v, meta, window, b=backend: b.attend(
            q, k, v, jnp.int32(LAYER), meta, sm_scale=0.125, sliding_window=window))
        outs = {}
        for window in (5, 20, 0):
            out = attend(jnp.asarray(q), k_pool, v_pool, meta, jnp.int32(window))
            outs[window] = np.asarray(out).reshape(flat_q.shape)
            expected = _naive_ragged(flat_q, k_pool, v_pool, block_tables, rows, 0.125, window or None)
            np.testing.assert_allclose(outs[window], expected, rtol=2e-5, atol=2e-6, err_msg=f"{backend.name} {window}")
        assert attend._cache_size() == 1
        assert not np.allclose(outs[5], outs[0]) and not np.allclose(outs[20], outs[5])


@pytest.mark.parametrize(("pool_dtype", "window", "softcap"), [(np.float32, None, None), (jnp.bfloat16, 5, SOFTCAP)],
                         ids=["f32", "bf16-window5-cap"])
def test_sinks_add_a_logit_per_head_to_each_softmax_denominator(pool_dtype, window, softcap):
    """gpt-oss's attention sinks, traced (a layer's own), on ragged rows of decode tokens and prefill chunks: the
    naive softmax with exp(sink) more in each head's denominator; sinks near the scores change the output."""
    assert kernels_cpu.load() is not None, kernels_cpu.build_error()
    rng = np.random.default_rng(31)
    q, k_pool, v_pool, block_tables, rows = _ragged_inputs(rng, 9, 3, 64, 16, pool_dtype)
    _poison_unseen(k_pool, v_pool, block_tables, rows, window)
    sinks = rng.normal(1.0, 1.0, 9).astype(np.float32)
    run = jax.jit(lambda *args, sinks=None: kernels_cpu.paged_attention(
        *args, sm_scale=0.125, sliding_window=window, logit_softcap=softcap, sinks=sinks))
    out = run(q, k_pool, v_pool, jnp.int32(LAYER), block_tables, *rows, sinks=jnp.asarray(sinks))
    expected = _naive_ragged(q, k_pool, v_pool, block_tables, rows, 0.125, window, softcap, sinks)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-6)
    without = _naive_ragged(q, k_pool, v_pool, block_tables, rows, 0.125, window, softcap)
    assert np.abs(expected - without).max() > 0.05
    with pytest.raises(ValueError, match=r"sinks must be \[9\] \(one logit per query head\), not \[3\]"):
        run(q, k_pool, v_pool, jnp.int32(LAYER), block_tables, *rows, sinks=jnp.zeros(3))


def test_the_cpu_and_plain_xla_backends_take_sinks_on_every_step_layout():
    """Decode, padded prefill and ragged steps through both backends' `attend` with sinks and a window: the naive
    softmax with exp(sink) more in each head's denominator."""
    rng = np.random.default_rng(37)
    _, k_pool, v_pool, block_tables, lengths = _inputs(rng, 9, 3, 64, 16, 6, np.float32)
    layouts = _step_layouts(rng, lengths, block_tables, 9, 64)
    sinks = rng.normal(0.0, 1.0, 9).astype(np.float32)
    for backend in (CpuBackend(), ReferenceBackend()):
        attend = jax.jit(lambda q, k, v, meta, sinks, b=backend: b.attend(
            q, k, v, jnp.int32(LAYER), meta, sm_scale=0.125 / SOFTCAP_Q_SCALE, sliding_window=20, sinks=sinks))
        for q, meta, rows in layouts:
            flat_q = q.reshape(-1, *q.shape[2:])
            expected = _naive_ragged(flat_q, k_pool, v_pool, block_tables, rows, 0.125 / SOFTCAP_Q_SCALE, 20,
                                     sinks=sinks)
            out = np.asarray(attend(jnp.asarray(q), k_pool, v_pool, meta, jnp.asarray(sinks))).reshape(flat_q.shape)
            np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-6, err_msg=f"{backend.name} {q.shape}")


def test_a_negative_window_is_refused_by_the_wrapper_and_by_the_handler():
    assert kernels_cpu.load() is not None, kernels_cpu.build_error()
    q, k_pool, v_pool, block_tables, lengths = _inputs(np.random.default_rng(29), 4, 4, 32, 8, 5)
    with pytest.raises(ValueError, match=r"sliding_window must be an int >= 1 \(None or 0: no window\), got -3"):
        _decode(q, k_pool, v_pool, jnp.int32(LAYER), block_tables, lengths, sm_scale=0.125, sliding_window=-3)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"sliding_window must be one int32 >= 0 \(0: no window\)"):
        _call_handler(q, k_pool, v_pool, block_tables, lengths, window=-3)


def test_no_soft_cap_is_none_or_zero_and_a_bad_cap_is_refused():
    assert kernels_cpu.load() is not None, kernels_cpu.build_error()
    q, k_pool, v_pool, block_tables, lengths = _inputs(np.random.default_rng(19), 4, 4, 32, 8, 5)
    args = q, k_pool, v_pool, jnp.int32(LAYER), block_tables, lengths
    np.testing.assert_array_equal(_decode(*args, sm_scale=0.125, logit_softcap=0.0), _decode(*args, sm_scale=0.125))
    for cap in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="logit_softcap must be positive and finite"):
            _decode(*args, sm_scale=0.125, logit_softcap=cap)
    # ... and so does the FFI handler, for a caller that goes around the wrapper
    with pytest.raises(jax.errors.JaxRuntimeError, match="logit_softcap must be finite and positive, or 0 for none"):
        _call_handler(q, k_pool, v_pool, block_tables, lengths, logit_softcap=-1.0)


def _int8_pools(rng, k_pool, v_pool):
    """Each [L, Hkv, NB, BS, D] pool's rows (scaled by e^U(-2, 2) each, so the scales differ from token to token)
    quantized as XLA writes the int8 KV cache: int8 values and a float32 scale max|x| / 127 per row."""
    quantized = []
    for pool in (k_pool, v_pool):
        pool = pool * np.exp(rng.uniform(-2, 2, pool.shape[:-1]))[..., None].astype(np.float32)
        scales = (np.abs(pool).max(-1) / 127).astype(np.float32)
        quantized.append((np.round(pool / scales[..., None]).astype(np.int8), scales))
    return quantized


def _assert_int8_reads_as_float32_of_its_values(run, rng, k_pool, v_pool, block_tables, rows, window):
    """``run(k_pool, v_pool, **scales)`` on an int8 pool with NaN scales in every slot no row sees equals it on
    the float32 pool of the values (NaN there too), and depends on the scales."""
    (k_values, k_scales), (v_values, v_scales) = _int8_pools(rng, k_pool, v_pool)
    _poison_unseen(k_scales, v_scales, block_tables, rows, window)
    out = np.asarray(run(k_values, v_values, k_scales=k_scales, v_scales=v_scales))
    expected = np.asarray(run(k_values * k_scales[..., None], v_values * v_scales[..., None]))
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-6)
    assert not np.isnan(expected).any() and np.abs(expected).max() > 0.1


@pytest.mark.parametrize(("case", "window", "softcap"), [(CASES[0], None, None), (CASES[2], 5, SOFTCAP)],
                         ids=["9q3kv-d64-bs16", "8q2kv-d128-bs32-window5-softcap"])
def test_an_int8_pool_with_scales_reads_ragged_rows_as_the_float32_pool_of_its_values(case, window, softcap):
    """Decode tokens and prefill chunks in one ragged batch (`RAGGED_ROWS`), grouped query heads."""
    assert kernels_cpu.load() is not None, kernels_cpu.build_error()
    rng = np.random.default_rng(23)
    q, k_pool, v_pool, block_tables, rows = _ragged_inputs(rng, *case[:4], np.float32)
    q *= SOFTCAP_Q_SCALE if softcap else 1.0  # scores past the cap where there is one
    attend = jax.jit(lambda k, v, **scales: kernels_cpu.paged_attention(
        q, k, v, jnp.int32(LAYER), block_tables, *rows, sm_scale=case[2] ** -0.5,
        sliding_window=window, logit_softcap=softcap, **scales))
    _assert_int8_reads_as_float32_of_its_values(attend, rng, k_pool, v_pool, block_tables, rows, window)


@pytest.mark.parametrize("num_query", [1, 20], ids=["decode", "prefill-chunk-20"])
def test_an_int8_pool_with_scales_reads_padded_steps_as_the_float32_pool_of_its_values(num_query):
    """A padded decode step and a padded prefill chunk (`padded_paged_attention`), 16 query heads on one kv
    head, a sliding window of 20."""
    assert kernels_cpu.load() is not None, kernels_cpu.build_error()
    rng = np.random.default_rng(29)
    _, k_pool, v_pool, block_tables, lengths = _inputs(rng, *CASES[3])
    q_start = np.maximum(lengths - num_query, 0).astype(np.int32)
    q = rng.standard_normal((len(lengths), num_query, 16, 64)).astype(np.float32)
    attend = jax.jit(lambda k, v, **scales: kernels_cpu.padded_paged_attention(
        q, k, v, jnp.int32(LAYER), block_tables, q_start, lengths, sm_scale=0.125, sliding_window=20, **scales))
    rows = _padded_rows(q_start, lengths, num_query)
    _assert_int8_reads_as_float32_of_its_values(attend, rng, k_pool, v_pool, block_tables, rows, 20)


def test_int8_pool_scales_are_checked_with_clear_errors():
    assert kernels_cpu.load() is not None, kernels_cpu.build_error()
    q, k_pool, v_pool, block_tables, lengths = _inputs(np.random.default_rng(31), 4, 4, 32, 8, 5)
    (k_int8, k_scales), (v_int8, v_scales) = _int8_pools(np.random.default_rng(37), k_pool, v_pool)
    attend = lambda k, v, **scales: _decode(q, k, v, jnp.int32(LAYER), block_tables, lengths, sm_scale=0.125,
                                            **scales)
    refused = [
        ((k_int8, v_int8), {}, r"an int8 KV pool needs k_scales and v_scales: float32 \[L, Hkv, num_blocks, "),
        ((k_pool, v_pool), dict(k_scales=k_scales, v_scales=v_scales),
         "k_scales and v_scales go with an int8 KV pool, not a float32 one"),
        ((k_int8, v_int8), dict(k_scales=k_scales), "give both k_scales and v_scales"),
        ((k_int8, v_int8), dict(k_scales=k_scales, v_scales=None), "give both k_scales and v_scales"),
        ((k_int8, v_int8), dict(k_scales=k_scales[..., None], v_scales=v_scales),
         r"k_scales must be float32 \[3, 4, 64, 8\] \(the pool's shape without head_dim\), not float32 \[3, 4, 64, 8, "
         r"1\]"),
        ((k_int8, v_int8), dict(k_scales=k_scales, v_scales=v_scales.astype(jnp.bfloat16)),
         r"v_scales must be float32 \[3, 4, 64, 8\] .*, not bfloat16 \[3, 4, 64, 8\]"),
    ]
    for pools, scales, message in refused:
        with pytest.raises(ValueError, match=message):
            attend(*pools, **scales)
    # ... and so does the FFI handler, for a caller that goes around the wrapper
    for pools, scales, message in [((k_int8, v_int8), (), "an int8 KV pool needs both k_scales and v_scales"),
                                   ((k_int8, v_int8), (k_scales,), "an int8 KV pool needs both k_scales and v_scales"),
                                   ((k_pool, v_pool), (k_scales, v_scales), "go with int8 KV pools only"),
                                   ((k_int8, v_int8), (k_scales, v_scales[:1]), r"must be float32 \[L, Hkv, NB, BS\]")]:
        with pytest.raises(jax.errors.JaxRuntimeError, match=message):
            _call_handler(q, *pools, block_tables, lengths, *scales)
