"""Shared pieces of the paged-attention kernels: backend choice, input validation, tuning lookup and the
online-softmax step that every kernel body (TPU and GPU, decode and prefill) runs per KV block.

Nothing here launches a kernel; ``paged_attention.py`` and ``prefill_attention.py`` own the kernels.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import tpu as pltpu

# Finite "minus infinity": exp(MASK_VALUE - m) == 0 for any real m, and MASK_VALUE - MASK_VALUE == 0 (no NaN).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
SUPPORTED_PAGE_SIZES = (16, 32, 64, 128)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
BACKENDS = ("auto", "tpu", "gpu")


def resolve_backend(backend: str, interpret) -> str:
    """Maps ``backend`` to "tpu" or "gpu".

    "auto" follows ``jax.default_backend()``: tpu -> "tpu", gpu/cuda/rocm -> "gpu". On any other platform
    (CPU) "auto" picks the TPU variant only when ``interpret`` is set, since Pallas runs there only in
    interpret mode; otherwise it raises.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    platform = jax.default_backend()
    if platform == "tpu":
        return "tpu"
    if platform in ("gpu", "cuda", "rocm"):
        return "gpu"
    if interpret:
        return "tpu"
    raise ValueError(
        f"backend='auto' found no accelerator (platform {platform!r}); Pallas kernels run there only in "
        "interpret mode: pass interpret=True (auto then uses the TPU variant) or backend='tpu'/'gpu' "
        "with interpret=True"
    )


def interpret_arg(backend: str, interpret):
    """The ``interpret`` value for ``pl.pallas_call``: TPU kernels use the TPU interpreter, which simulates
    VMEM, DMAs and semaphores (and raises on out-of-bounds reads); GPU kernels use the generic one."""
    if not interpret:
        return False
    if backend == "tpu":
        return interpret if isinstance(interpret, pltpu.InterpretParams) else pltpu.InterpretParams()
    return True


def is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def fit_pages_per_block(requested: int, pages_per_seq: int) -> int:
    """Largest power of two <= ``requested`` that does not exceed the block table width."""
    return min(requested, 1 << (pages_per_seq.bit_length() - 1))


def tuned_knobs(table: dict, key: tuple, default: dict, **overrides) -> dict:
    """Knobs from ``table[key]`` (or ``default``), with explicitly passed (non-None) knobs on top."""
    knobs = dict(table.get(key, default))
    knobs.update({name: value for name, value in overrides.items() if value is not None})
    return knobs


def check_positive_power_of_2(name: str, value: int, minimum: int = 1) -> None:
    if not isinstance(value, int) or value < minimum or not is_power_of_2(value):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value!r}")


def reject_knobs(backend: str, **knobs) -> None:
    """Raises if a knob that the chosen backend does not use was passed."""
    for name, value in knobs.items():
        if value is not None:
            raise ValueError(f"{name} is a knob of the other backend; it is not used by backend={backend!r}")


def check_kv_pages(k_pages: jax.Array, v_pages: jax.Array) -> tuple[int, int, int, int]:
    """Validates the per-layer KV pool; returns (num_kv_heads, total_pages, page_size, head_dim)."""
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be [num_kv_heads, total_pages, page_size, head_dim], got shape {k_pages.shape}"
        )
    if k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages and v_pages must have the same shape, got {k_pages.shape} and {v_pages.shape}"
        )
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(
            f"k_pages and v_pages must have the same dtype, got {k_pages.dtype} and {v_pages.dtype}"
        )
    if k_pages.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"k_pages dtype must be float32 or bfloat16, got {k_pages.dtype}")
    num_kv_heads, total_pages, page_size, head_dim = k_pages.shape
    if page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"page_size must be one of {SUPPORTED_PAGE_SIZES}, got {page_size}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    return num_kv_heads, total_pages, page_size, head_dim


def check_query(q: jax.Array, kv_dtype, num_kv_heads: int, head_dim: int, layout: str) -> None:
    """Validates q's dtype and its trailing [num_q_heads, head_dim] dims against the KV pool."""
    if q.dtype != kv_dtype:
        raise ValueError(f"q dtype ({q.dtype}) must match the k_pages/v_pages dtype ({kv_dtype})")
    if q.shape[-1] != head_dim:
        raise ValueError(
            f"q head_dim ({q.shape[-1]}) must match the k_pages head_dim ({head_dim}); q is {layout}"
        )
    num_q_heads = q.shape[-2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")


def check_int_vector(name: str, x: jax.Array, num_seqs: int) -> None:
    if x.shape != (num_seqs,):
        raise ValueError(f"{name} must have shape (num_seqs,) = ({num_seqs},), got {x.shape}")
    if x.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32, got {x.dtype}")


def check_page_indices(page_indices: jax.Array, num_seqs: int) -> int:
    """Validates the block table; returns pages_per_seq."""
    if page_indices.ndim != 2 or page_indices.shape[0] != num_seqs:
        raise ValueError(
            f"page_indices must have shape (num_seqs, pages_per_seq) with num_seqs={num_seqs}, "
            f"got {page_indices.shape}"
        )
    if page_indices.dtype != jnp.int32:
        raise ValueError(f"page_indices must be int32, got {page_indices.dtype}")
    return page_indices.shape[1]


def default_scale(sm_scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)


def logits(q: jax.Array, k: jax.Array, sm_scale: float) -> jax.Array:
    """f32[rows, block_tokens] = (q[rows, d] @ k[block_tokens, d].T) * sm_scale, accumulated in float32."""
    dims = (((1,), (1,)), ((), ()))
    return lax.dot_general(q, k, dims, preferred_element_type=jnp.float32) * sm_scale


def live_pages_only(pages: jax.Array, first_page, end_page) -> jax.Array:
    """i32[n] block-table entries for pages first_page.. with entries at or past end_page replaced by page 0,
    so a gather never dereferences the table's padding (which may hold anything)."""
    page_no = first_page + lax.broadcasted_iota(jnp.int32, pages.shape, 0)
    return jnp.where(page_no < end_page, pages, 0)


def zero_invalid_rows(x: jax.Array, valid: jax.Array) -> jax.Array:
    """Zeroes rows of x[n, d] where valid[n, 1] is False: NaN garbage in masked tokens stays out of dots."""
    return jnp.where(valid, x, jnp.zeros_like(x))


def row_positions(first_pos, rows: int, block_q: int) -> jax.Array:
    """i32[rows, 1] positions of a query block's head-major rows (row = head * block_q + token; block_q a
    power of 2), its first token at ``first_pos``."""
    return first_pos + (lax.broadcasted_iota(jnp.int32, (rows, 1), 0) & (block_q - 1))


def causal_block_step(state, q, k, v, *, first_key, row_pos, length, kv_end, sm_scale):
    """Online-softmax update of a query block's rows with one KV block of tokens first_key..: a row attends
    keys at or before its position and below ``length``; tokens at or past ``kv_end`` are zeroed in v."""
    s = logits(q, k, sm_scale)  # f32[rows, block_tokens]
    key = first_key + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    mask = (key <= row_pos) & (key < length)
    token_ok = first_key + lax.broadcasted_iota(jnp.int32, (k.shape[0], 1), 0) < kv_end
    return online_softmax_step(state, s, mask, zero_invalid_rows(v, token_ok))


def init_softmax_state(rows: int, head_dim: int):
    """(m f32[rows, 1], l f32[rows, 1], acc f32[rows, head_dim]) before the first KV block."""
    return (
        jnp.full((rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )


def online_softmax_step(state, s: jax.Array, mask: jax.Array, v: jax.Array):
    """Folds one KV block into the running (max, sum, unnormalised output) of every query row.

    s: f32[rows, block_tokens] logits; mask: bool[rows, block_tokens] (True = attend);
    v: [block_tokens, head_dim] values with masked-out tokens already zeroed.
    """
    m_prev, l_prev, acc_prev = state
    s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
    l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_next, l_next, alpha * acc_prev + pv


def finalize(state) -> jax.Array:
    """f32[rows, head_dim] attention output; rows that attended to nothing come out as zeros."""
    _, denom, acc = state
    return acc / jnp.where(denom == 0.0, 1.0, denom)
