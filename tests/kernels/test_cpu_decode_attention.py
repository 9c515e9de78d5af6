"""The native XLA:CPU decode attention (`kernels_cpu`) against a naive numpy attention and the engine's
plain-XLA attention, on the stacked pool with shuffled pages; the build's failure path; the backend choice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from jaxserve.attention import AttentionMetadata, CpuBackend, ReferenceBackend, get_attention_backend

# (num_q_heads, num_kv_heads, head_dim, block_size, pages_per_seq)
CASES = [(9, 3, 64, 16, 6), (4, 4, 32, 8, 5), (8, 2, 128, 32, 3), (16, 1, 64, 4, 9)]
NUM_LAYERS, NUM_BLOCKS, LAYER = 3, 64, 2


def _inputs(rng, num_q_heads, num_kv_heads, head_dim, block_size, pages_per_seq):
    capacity = block_size * pages_per_seq
    # lengths: 0 (a padding row), 1, one short of a page, a page, one past it, the full table, random
    lengths = np.array([0, 1, block_size - 1, block_size, block_size + 1, capacity, rng.integers(2, capacity)])
    pool_shape = (NUM_LAYERS, num_kv_heads, NUM_BLOCKS, block_size, head_dim)
    k_pool = rng.standard_normal(pool_shape).astype(np.float32)
    v_pool = rng.standard_normal(pool_shape).astype(np.float32)
    pages = rng.permutation(NUM_BLOCKS)[: len(lengths) * pages_per_seq]
    block_tables = pages.reshape(len(lengths), pages_per_seq).astype(np.int32)
    q = rng.standard_normal((len(lengths), num_q_heads, head_dim)).astype(np.float32)
    return q, k_pool, v_pool, block_tables, lengths.astype(np.int32)


def _naive(q, k_pool, v_pool, block_tables, lengths, sm_scale, window=None):
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_pool.shape[1], k_pool.shape[3]
    out = np.zeros_like(q, dtype=np.float64)
    for s in range(num_seqs):
        first = 0 if window is None else max(0, lengths[s] - window)
        positions = np.arange(first, lengths[s])
        blocks = block_tables[s, positions // block_size]
        for h in range(num_q_heads):
            kv = h // (num_q_heads // num_kv_heads)
            keys = k_pool[LAYER, kv, blocks, positions % block_size].astype(np.float64)
            values = v_pool[LAYER, kv, blocks, positions % block_size].astype(np.float64)
            if len(positions):
                scores = keys @ q[s, h] * sm_scale
                weights = np.exp(scores - scores.max())
                out[s, h] = weights @ values / weights.sum()
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}q{c[1]}kv-d{c[2]}-bs{c[3]}" for c in CASES])
@pytest.mark.parametrize("window", [None, 5])
def test_kernel_matches_naive_attention(case, window):
    assert kernels_cpu.load() is not None, kernels_cpu.build_error()
    q, k_pool, v_pool, block_tables, lengths = _inputs(np.random.default_rng(sum(case)), *case)
    sm_scale = case[2] ** -0.5
    run = jax.jit(lambda *args: kernels_cpu.paged_decode_attention(*args, sm_scale=sm_scale, sliding_window=window))
    out = run(q, k_pool, v_pool, jnp.int32(LAYER), block_tables, lengths)
    np.testing.assert_allclose(np.asarray(out), _naive(q, k_pool, v_pool, block_tables, lengths, sm_scale, window),
                               rtol=2e-5, atol=2e-6)
    assert not np.asarray(out)[0].any()  # the padding row (length 0) is zeros


def test_cpu_backend_equals_the_plain_xla_backend_on_decode_and_prefill():
    rng = np.random.default_rng(7)
    q, k_pool, v_pool, block_tables, lengths = _inputs(rng, 9, 3, 64, 16, 6)
    meta = AttentionMetadata(block_tables=jnp.asarray(block_tables), q_start=jnp.asarray(np.maximum(lengths - 1, 0)),
                             lengths=jnp.asarray(lengths))
    attend = lambda backend, q, meta: jax.jit(
        lambda q, k, v, meta: backend.attend(q, k, v, jnp.int32(LAYER), meta, sm_scale=0.125)
    )(q, k_pool, v_pool, meta)
    decode_q = jnp.asarray(q[:, None])
    np.testing.assert_allclose(attend(CpuBackend(), decode_q, meta), attend(ReferenceBackend(), decode_q, meta),
                               rtol=2e-5, atol=2e-6)
    # A prefill chunk (4 query tokens ending at each length) takes the plain-XLA path: identical results.
    chunk_meta = AttentionMetadata(block_tables=meta.block_tables, q_start=jnp.maximum(meta.lengths - 4, 0),
                                   lengths=meta.lengths)
    chunk_q = jnp.asarray(rng.standard_normal((len(lengths), 4, 9, 64)).astype(np.float32))
    np.testing.assert_array_equal(attend(CpuBackend(), chunk_q, chunk_meta),
                                  attend(ReferenceBackend(), chunk_q, chunk_meta))


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


def test_out_of_range_block_ids_are_clamped_like_xla_gathers():
    q, k_pool, v_pool, block_tables, lengths = _inputs(np.random.default_rng(3), 9, 3, 64, 16, 6)
    bad = block_tables.copy()
    bad[5, 0], bad[6, 1] = NUM_BLOCKS + 7, -3
    clamped = np.clip(bad, 0, NUM_BLOCKS - 1)
    run = jax.jit(lambda tables: kernels_cpu.paged_decode_attention(
        q, k_pool, v_pool, jnp.int32(LAYER), tables, lengths, sm_scale=0.125))
    np.testing.assert_array_equal(run(bad), run(clamped))
    np.testing.assert_allclose(run(bad), _naive(q, k_pool, v_pool, clamped, lengths, 0.125), rtol=2e-5, atol=2e-6)
