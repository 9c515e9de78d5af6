"""Builders for paged KV test cases (one-layer or stacked pools), a naive numpy attention (with the optional
sliding window, logit soft-cap and sinks) and the pages a windowed kernel must skip, and the platforms, dtypes and
variants every kernel is lowered with for real hardware, shared by the kernel tests.

Every pool page that no sequence uses below its length, and every token slot past a sequence's length in
its last page, holds NaN; block-table entries past a sequence's length point at a NaN page. A kernel that
reads a token it should not, or lets a masked token leak into a dot, returns NaN.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

TOLERANCES = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

# Each kernel's lowering for real hardware (Mosaic, Triton): on both platforms, over every query and pool dtype
LOWERING_PLATFORMS = pytest.mark.parametrize("kernel_backend,platform", [("tpu", "tpu"), ("gpu", "cuda")])
LOWERING_DTYPES = pytest.mark.parametrize(
    "dtype,pool_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16),
                         (jnp.bfloat16, jnp.float8_e4m3fn), (jnp.bfloat16, jnp.int8)],
    ids=["f32", "bf16", "bf16-fp8-pool", "bf16-int8-pool"])


def lowering_variants(num_q_heads: int):
    """The variants each kernel is lowered with: none, a static window and soft-cap, and a traced window with
    sinks (ShapeDtypeStructs: traced, never run)."""
    traced = {"sliding_window": jax.ShapeDtypeStruct((), jnp.int32),
              "sinks": jax.ShapeDtypeStruct((num_q_heads,), jnp.float32)}
    return pytest.mark.parametrize("variants", [{}, {"sliding_window": 40, "logit_softcap": 50.0}, traced],
                                   ids=["plain", "window-cap", "traced-window-sinks"])


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


def window_start(position: int, sliding_window: int | None) -> int:
    """The first key position a query at ``position`` attends: 0, or the start of its sliding window."""
    return 0 if sliding_window is None else max(0, position - sliding_window + 1)


def window_keys(position: int, sliding_window: int | None) -> np.ndarray:
    """Key positions a query at ``position`` attends: 0..position, or its last ``sliding_window`` of them."""
    return np.arange(window_start(position, sliding_window), position + 1)


def naive_scores(keys, q, sm_scale, logit_softcap=None):
    """Scaled scores keys @ q * sm_scale, soft-capped to c * tanh(s / c) for a cap c."""
    s = keys @ q * sm_scale
    return s if logit_softcap is None else logit_softcap * np.tanh(s / logit_softcap)


def naive_attention(q_rows, k, v, positions, sm_scale, sliding_window=None, logit_softcap=None, sinks=None):
    """Dense causal softmax attention in float64 for one sequence (optionally windowed, soft-capped and with a
    sink logit per query head in its softmax's denominator).

    q_rows f64[n, num_q_heads, d] at token positions[n]; k, v f64[length, num_kv_heads, d].
    """
    num_q_heads = q_rows.shape[1]
    group = num_q_heads // k.shape[1]
    out = np.zeros(q_rows.shape)
    for i, pos in enumerate(positions):
        keys = window_keys(pos, sliding_window)
        for h in range(num_q_heads):
            s = naive_scores(k[keys, h // group], q_rows[i, h], sm_scale, logit_softcap)
            out[i, h] = naive_softmax(s, v[keys, h // group], None if sinks is None else sinks[h])
    return out


def naive_softmax(scores, values, sink=None):
    """softmax(scores) @ values in float64; with a ``sink`` logit, exp(sink) more in the denominator (gpt-oss's
    attention sinks: a term with no value)."""
    top = scores.max() if sink is None else max(scores.max(), sink)
    weights = np.exp(scores - top)
    extra = 0.0 if sink is None else np.exp(sink - top)
    return weights @ values / (weights.sum() + extra)


def first_read_page(first_pos: int, sliding_window: int | None, page_size: int, backend: str,
                    pages_per_block: int) -> int:
    """The first page a windowed kernel reads for queries from ``first_pos`` on: the TPU variants start at
    the page of the window's first key, the GPU variants at the compute block holding it."""
    page = window_start(first_pos, sliding_window) // page_size
    return page if backend == "tpu" else page - page % pages_per_block


def poison_pages_before(kv: PagedKV, first_pages) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(k_pages, v_pages) with NaN in every page of sequence s before its block-table entry first_pages[s]:
    a kernel that reads a page it should skip returns NaN."""
    table = np.asarray(kv.page_indices)
    skipped = np.concatenate([table[s, :first] for s, first in enumerate(first_pages)]).astype(int)
    return tuple(x.at[:, skipped].set(jnp.nan) for x in (kv.k_pages, kv.v_pages))


STACK_LAYERS, STACK_LAYER = 3, 1


def pool_at_layer(pages: jnp.ndarray, layout: str):
    """(pool, layer): one layer's pages [Hkv, P, page_size, D] as layer STACK_LAYER of a pool of STACK_LAYERS
    layers, the others NaN (a kernel that reads outside its layer returns NaN), in the plain layout
    ("stacked") or the TPU kernels' "lane-dense" one (128 // D tokens per 128-lane row)."""
    if layout not in ("stacked", "lane-dense"):
        raise ValueError(f"unknown pool layout {layout!r}")
    pool = jnp.full((STACK_LAYERS, *pages.shape), jnp.nan, pages.dtype).at[STACK_LAYER].set(pages)
    if layout == "lane-dense":  # row-major: token t of a page is row t // n, lanes (t % n) * D.. of the same bytes
        page_size, head_dim = pages.shape[-2:]
        tokens_per_row = 128 // head_dim
        pool = pool.reshape(*pool.shape[:3], page_size // tokens_per_row, tokens_per_row * head_dim)
    return pool, jnp.int32(STACK_LAYER)


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
