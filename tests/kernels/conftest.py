"""Builders for paged KV test cases and a naive numpy attention, shared by the kernel tests.

Every pool page that no sequence uses below its length, and every token slot past a sequence's length in
its last page, holds NaN; block-table entries past a sequence's length point at a NaN page. A kernel that
reads a token it should not, or lets a masked token leak into a dot, returns NaN.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax.numpy as jnp
import numpy as np
import pytest

TOLERANCES = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


@dataclasses.dataclass
class PagedKV:
    k_pages: jnp.ndarray  # [num_kv_heads, total_pages, page_size, head_dim]
    v_pages: jnp.ndarray  # [num_kv_heads, total_pages, page_size, head_dim]
    page_indices: jnp.ndarray  # i32[num_seqs, pages_per_seq]
    lengths: jnp.ndarray  # i32[num_seqs]
    k_dense: list  # per sequence f64[length, num_kv_heads, head_dim], read token by token
    v_dense: list


def make_paged_kv(rng, *, lengths, num_kv_heads, head_dim, page_size, pages_per_seq, dtype, spare_pages=2):
    num_seqs = len(lengths)
    total_pages = num_seqs * pages_per_seq + spare_pages
    shape = (num_kv_heads, total_pages, page_size, head_dim)
    k = np.array(jnp.asarray(rng.standard_normal(shape), dtype).astype(jnp.float32))
    v = np.array(jnp.asarray(rng.standard_normal(shape), dtype).astype(jnp.float32))
    perm = rng.permutation(total_pages)
    table = perm[: num_seqs * pages_per_seq].reshape(num_seqs, pages_per_seq).astype(np.int32)
    nan_page = perm[-1]
    live = np.zeros((total_pages, page_size), bool)
    k_dense, v_dense = [], []
    for s, length in enumerate(lengths):
        used = -(-length // page_size)
        table[s, used:] = nan_page
        tokens = [(table[s, j // page_size], j % page_size) for j in range(length)]
        for page, slot in tokens:
            live[page, slot] = True
        k_dense.append(np.stack([k[:, p, o] for p, o in tokens]).astype(np.float64) if tokens else None)
        v_dense.append(np.stack([v[:, p, o] for p, o in tokens]).astype(np.float64) if tokens else None)
    k[:, ~live] = np.nan
    v[:, ~live] = np.nan
    return PagedKV(
        k_pages=jnp.asarray(k, dtype),
        v_pages=jnp.asarray(v, dtype),
        page_indices=jnp.asarray(table),
        lengths=jnp.asarray(lengths, jnp.int32),
        k_dense=k_dense,
        v_dense=v_dense,
    )


def naive_attention(q_rows, k, v, positions, sm_scale):
    """Dense causal softmax attention in float64 for one sequence.

    q_rows f64[n, num_q_heads, d] at token positions[n]; k, v f64[length, num_kv_heads, d].
    """
    num_q_heads = q_rows.shape[1]
    group = num_q_heads // k.shape[1]
    out = np.zeros(q_rows.shape)
    for i, pos in enumerate(positions):
        for h in range(num_q_heads):
            keys, values = k[: pos + 1, h // group], v[: pos + 1, h // group]
            s = keys @ q_rows[i, h] * sm_scale
            p = np.exp(s - s.max())
            out[i, h] = p @ values / p.sum()
    return out


@pytest.fixture
def rng(request):
    """Deterministic per test (and per parametrization)."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.fixture
def make_kv():
    return make_paged_kv


@pytest.fixture
def naive():
    return naive_attention


@pytest.fixture
def tol():
    return lambda dtype: TOLERANCES[dtype]
