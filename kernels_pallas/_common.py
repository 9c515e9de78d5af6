"""Shared pieces of the paged-attention kernels: backend choice, input validation, tuning lookup, the
attention mask (causal, length and the optional sliding window), the optional logit soft-cap, the per-token
scales of an int8 pool, and the online-softmax step that every kernel body (TPU and GPU, decode and prefill)
runs per KV block.

The int8 KV cache (`kv_cache_dtype="int8"`, vLLM's ``int8_per_token_head``): the engine writes each K and V
row of one token and one kv head as int8 values with a float32 scale max|x| / 127 (XLA, outside the
kernels), the values into the pool and the scales into ``k_scales`` / ``v_scales`` ``[num_layers,
num_kv_heads, total_pages, page_size]`` (token t of page p at ``[..., p, t]`` whatever the pool's lane
layout). A kernel reads K as value * scale: the int8 block is widened to the query's dtype for the dots, the
K scales multiply the scores (``logits``) and the V scales the softmax weights before P @ V
(``online_softmax_parts``), as vLLM and flashinfer do; scales of tokens at or past ``kv_end`` are zeroed
first (``valid_scales``), so garbage there (NaN included) never reaches a dot. How the scales reach a
kernel: ``gpu_token_scales`` (by page offset, like the pages) and ``_tpu_paging`` (gathered, then DMA'd).

Nothing here launches a kernel; ``paged_attention.py``, ``prefill_attention.py`` and
``ragged_paged_attention.py`` own the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Finite "minus infinity": exp(MASK_VALUE - m) == 0 for any real m, and MASK_VALUE - MASK_VALUE == 0 (no NaN).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# a float8 pool (`kv_cache_dtype="fp8"`) holds K/V rounded to e4m3; q stays in float32 or bfloat16 and every page
# is widened to q's dtype as it is read (`kv_values`)
FLOAT8_POOL_DTYPES = (jnp.dtype(jnp.float8_e4m3fn),)
# an int8 pool (`kv_cache_dtype="int8"`) holds K/V as int8 with a float32 scale per token and kv head
# (``check_kv_scales``); q stays in float32 or bfloat16 and every page is widened to q's dtype as it is read
INT8_POOL_DTYPE = jnp.dtype(jnp.int8)
WIDENED_POOL_DTYPES = FLOAT8_POOL_DTYPES + (INT8_POOL_DTYPE,)  # pools read under a float32 / bfloat16 q
POOL_DTYPES = SUPPORTED_DTYPES + WIDENED_POOL_DTYPES
SCALES_DTYPE = jnp.dtype(jnp.float32)
SUPPORTED_PAGE_SIZES = (16, 32, 64, 128)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
BACKENDS = ("auto", "tpu", "gpu")
GPU_PLATFORMS = ("gpu", "cuda", "rocm")  # JAX platforms whose Pallas kernels are the Triton variants
LANES = 128  # a TPU vreg's lane count: the minor dimension of every tile


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
    if platform in GPU_PLATFORMS:
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


@dataclasses.dataclass(frozen=True)
class PoolGeometry:
    """A KV pool as the kernels read it: ``[num_layers, num_kv_heads, total_pages, rows, lanes]`` where a
    page of ``page_size`` tokens is ``rows`` rows of ``lanes = tokens_per_row * head_dim`` values, token t of
    the page at row t // tokens_per_row, lanes (t % tokens_per_row) * head_dim onwards. tokens_per_row is 1
    (the plain layout) or, for the TPU kernels, 128 // head_dim when head_dim < 128 ("lane-dense": a TPU
    tile is 128 lanes wide, and a pool whose last dimension is 64 is laid out by XLA with the pages
    dimension minor, which a Mosaic kernel can only read after a relayout copy of the whole pool)."""

    num_layers: int
    num_kv_heads: int
    total_pages: int
    page_size: int
    head_dim: int
    tokens_per_row: int

    @property
    def rows_per_page(self) -> int:
        return self.page_size // self.tokens_per_row

    @property
    def lanes(self) -> int:
        return self.tokens_per_row * self.head_dim


def lane_dense_tokens_per_row(page_size: int, head_dim: int) -> int:
    """Tokens per pool row of the TPU kernels' lane-dense layout: 128 // head_dim for head_dim < 128 when a
    page fills whole rows, else 1."""
    if head_dim < LANES and LANES % head_dim == 0 and page_size % (LANES // head_dim) == 0:
        return LANES // head_dim
    return 1


def check_kv_pool(k_pool: jax.Array, v_pool: jax.Array, head_dim: int) -> PoolGeometry:
    """Validates a KV pool: one layer ``[num_kv_heads, total_pages, page_size, head_dim]`` or the stacked pool
    ``[num_layers, num_kv_heads, total_pages, rows, lanes]`` (see ``PoolGeometry``)."""
    if k_pool.ndim not in (4, 5):
        raise ValueError(
            "k_pages must be one layer [num_kv_heads, total_pages, page_size, head_dim] or the stacked pool "
            f"[num_layers, num_kv_heads, total_pages, rows, lanes], got shape {k_pool.shape}"
        )
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pages and v_pages must have the same shape, got {k_pool.shape} and {v_pool.shape}")
    if k_pool.dtype != v_pool.dtype:
        raise ValueError(f"k_pages and v_pages must have the same dtype, got {k_pool.dtype} and {v_pool.dtype}")
    if k_pool.dtype not in POOL_DTYPES:
        raise ValueError(f"k_pages dtype must be float32, bfloat16, float8_e4m3fn or int8, got {k_pool.dtype}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    num_layers = k_pool.shape[0] if k_pool.ndim == 5 else 1
    num_kv_heads, total_pages, rows, lanes = k_pool.shape[-4:]
    if lanes % head_dim or not is_power_of_2(lanes // head_dim):
        raise ValueError(
            f"the pool's last dimension ({lanes}) must be head_dim ({head_dim}) times a power of two "
            "(tokens per row)"
        )
    tokens_per_row = lanes // head_dim
    page_size = rows * tokens_per_row
    if page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"page_size must be one of {SUPPORTED_PAGE_SIZES}, got {page_size}")
    return PoolGeometry(num_layers, num_kv_heads, total_pages, page_size, head_dim, tokens_per_row)


def stacked_pool(pool: jax.Array, layer) -> tuple[jax.Array, jax.Array]:
    """(pool as ``[num_layers, ...]``, i32[1] layer index): a one-layer pool is layer 0 of a stack of one."""
    if pool.ndim == 4:
        if layer is not None:
            raise ValueError("layer must be None for a one-layer pool [num_kv_heads, total_pages, ...]")
        return pool[None], jnp.zeros((1,), jnp.int32)
    if layer is None:
        raise ValueError("a stacked pool [num_layers, ...] needs the layer index (layer=...)")
    layer = jnp.asarray(layer, jnp.int32)
    if layer.ndim != 0:
        raise ValueError(f"layer must be a scalar, got shape {layer.shape}")
    return pool, layer.reshape(1)


def stacked_kv(k_pages, v_pages, k_scales, v_scales, layer):
    """(k_pool, v_pool, k_scales, v_scales, i32[1] layer index) with the pools and scales (None: none) as
    stacks of layers (``stacked_pool``): a one-layer pool and its scales are layer 0 of a stack of one."""
    k_pool, layer_index = stacked_pool(k_pages, layer)
    v_pool, _ = stacked_pool(v_pages, layer)
    if k_scales is not None and k_pages.ndim == 4:
        k_scales, v_scales = k_scales[None], v_scales[None]
    return k_pool, v_pool, k_scales, v_scales, layer_index


def layer_pages(pool: jax.Array, layer: jax.Array, geometry: PoolGeometry) -> jax.Array:
    """One layer of a stacked pool in the plain layout ``[num_kv_heads, total_pages, page_size, head_dim]``
    (plain XLA: a reshape of the lane-dense layout; for references and tests)."""
    g = geometry
    return pool[layer[0]].reshape(g.num_kv_heads, g.total_pages, g.page_size, g.head_dim)


def reference_pages(k_pages, v_pages, layer, geometry: PoolGeometry, k_scales=None, v_scales=None):
    """(k, v) of one layer in the plain layout (``layer_pages``) for the references: an int8 pool as float32
    values times its scales (NaN where a garbage scale is; the references mask by ``where``)."""
    k_pool, v_pool, k_scales, v_scales, layer_index = stacked_kv(k_pages, v_pages, k_scales, v_scales, layer)
    pages = [layer_pages(x, layer_index, geometry) for x in (k_pool, v_pool)]
    if k_scales is None:
        return tuple(pages)
    scales = (k_scales, v_scales)
    return tuple(x.astype(jnp.float32) * s[layer_index[0], ..., None] for x, s in zip(pages, scales, strict=True))


def flat_pages(pool: jax.Array) -> jax.Array:
    """A stacked plain-layout pool ``[L, Hkv, P, page_size, D]`` as ``[L * Hkv * P, page_size, D]`` (the GPU
    kernels address pages by offset: see ``first_page_of``); its scales ``[L, Hkv, P, page_size]`` as
    ``[L * Hkv * P, page_size]``."""
    return pool.reshape(-1, *pool.shape[3:])


def gpu_pool_operands(k_pool, v_pool, k_scales, v_scales):
    """(in_specs, arrays) of a GPU kernel's pool: the stacked pools' pages (``flat_pages``) and an int8 pool's
    scales flattened alike, each whole at every grid point (the kernels address pages by offset)."""
    arrays = [flat_pages(x) for x in (k_pool, v_pool) + ((k_scales, v_scales) if k_scales is not None else ())]
    return [pl.BlockSpec(x.shape, lambda *_, rank=x.ndim: (0,) * rank) for x in arrays], arrays


def first_page_of(layer, head, num_kv_heads: int, total_pages: int):
    """Index in ``flat_pages`` of page 0 of ``layer``'s kv head ``head``."""
    return (layer * num_kv_heads + head) * total_pages


def check_gpu_layout(geometry: PoolGeometry) -> None:
    if geometry.tokens_per_row != 1:
        raise ValueError(
            "the GPU kernels read the plain pool layout (last dimension head_dim); got "
            f"{geometry.tokens_per_row} tokens per row"
        )


def check_query(q: jax.Array, kv_dtype, num_kv_heads: int, head_dim: int, layout: str) -> None:
    """Validates q's dtype and its trailing [num_q_heads, head_dim] dims against the KV pool: q has the pool's
    dtype, or float32 / bfloat16 over a float8 or int8 pool."""
    if kv_dtype in WIDENED_POOL_DTYPES:
        if q.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"q dtype ({q.dtype}) must be float32 or bfloat16 over a pool of {kv_dtype}")
    elif q.dtype != kv_dtype:
        raise ValueError(f"q dtype ({q.dtype}) must match the k_pages/v_pages dtype ({kv_dtype})")
    if q.shape[-1] != head_dim:
        raise ValueError(
            f"q head_dim ({q.shape[-1]}) must match the k_pages head_dim ({head_dim}); q is {layout}"
        )
    num_q_heads = q.shape[-2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")


def check_query_and_pool(
    q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layout: str, k_scales=None, v_scales=None
) -> PoolGeometry:
    """Validates q (``layout`` names its dims, its last two [num_q_heads, head_dim]) against the pool and the
    pool's scales (``check_kv_scales``); a one-layer pool is in the plain layout, so its last dimension is
    the head_dim q must have."""
    geometry = check_kv_pool(k_pool, v_pool, k_pool.shape[-1] if k_pool.ndim == 4 else q.shape[-1])
    check_kv_scales(k_pool, k_scales, v_scales, geometry)
    check_query(q, k_pool.dtype, geometry.num_kv_heads, geometry.head_dim, layout)
    return geometry


def check_kv_scales(k_pool: jax.Array, k_scales, v_scales, geometry: PoolGeometry) -> None:
    """An int8 pool comes with both scale arrays, float32 ``[num_layers, num_kv_heads, total_pages,
    page_size]`` for a stacked pool (``[num_kv_heads, total_pages, page_size]`` for one layer); other pools
    with neither."""
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales must be given together (an int8 pool needs both)")
    if k_pool.dtype != INT8_POOL_DTYPE:
        if k_scales is not None:
            raise ValueError(f"k_scales/v_scales are read only with an int8 pool, got a {k_pool.dtype} pool")
        return
    if k_scales is None:
        raise ValueError("an int8 pool needs k_scales and v_scales (float32, a scale per token and kv head)")
    g = geometry
    shape = (g.num_kv_heads, g.total_pages, g.page_size)
    shape = shape if k_pool.ndim == 4 else (g.num_layers, *shape)
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if scales.shape != shape:
            dims = "[num_kv_heads, total_pages, page_size]"
            dims = dims if k_pool.ndim == 4 else f"[num_layers, {dims[1:]}"
            raise ValueError(f"{name} must have shape {shape} ({dims} of the pool), got {scales.shape}")
        if scales.dtype != SCALES_DTYPE:
            raise ValueError(f"{name} must be float32, got {scales.dtype}")


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


class TracedWindow:
    """The static stand-in for a traced sliding window: the kernels read it from their layer operand
    (``window_in_layer``, ``kernel_window``)."""

    def __repr__(self) -> str:
        return "TRACED"


TRACED = TracedWindow()
# a traced window of 0 (no window: a full layer of a model that mixes them) becomes this one: every key a query
# can have lies in it, so a kernel masks and skips nothing, with no branch on it
NO_WINDOW = 1 << 30


def jit_with_window(static_argnames: tuple[str, ...]):
    """``jax.jit`` of a kernel's public function with ``static_argnames``, where ``sliding_window`` is static
    when it is None or a Python int (a kernel without a window compiles as if windows did not exist) and traced
    when it is an array (or, to ``trace``, a ShapeDtypeStruct): a model whose layers differ in window passes each
    layer's own from inside its layer scan, and one compiled call serves them all."""
    return functools.partial(WindowJit, static_argnames=static_argnames)


class WindowJit:
    """`jit_with_window`'s function: two jits of it, picked per call by the kind of ``sliding_window``."""

    def __init__(self, fn, static_argnames: tuple[str, ...]):
        functools.update_wrapper(self, fn)
        self.static = jax.jit(fn, static_argnames=static_argnames)
        self.traced = jax.jit(fn, static_argnames=tuple(name for name in static_argnames if name != "sliding_window"))

    def _jitted(self, kwargs: dict):
        traced = isinstance(kwargs.get("sliding_window"), (jax.Array, jax.ShapeDtypeStruct))
        return self.traced if traced else self.static

    def __call__(self, *args, **kwargs):
        return self._jitted(kwargs)(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self._jitted(kwargs).trace(*args, **kwargs)


def window_in_layer(sliding_window, layer_index: jax.Array):
    """(the kernels' static window, their layer operand): a static window (int or None) and i32[1] [layer] as
    they are; a traced one as `TRACED` and i32[2] [layer, W], W = NO_WINDOW for 0 (no window)."""
    if not isinstance(sliding_window, jax.Array):
        return sliding_window, layer_index
    window = jnp.where(sliding_window > 0, sliding_window, NO_WINDOW).astype(jnp.int32).reshape(1)
    return TRACED, jnp.concatenate([layer_index.astype(jnp.int32), window])


def per_row_meta(columns: list[jax.Array], layer_index: jax.Array) -> jax.Array:
    """i32[rows, len(columns) + len(layer_index)]: the GPU kernels' per-row scalars, each row's columns then the
    layer operand (`window_in_layer`: the layer, and a traced window) repeated."""
    rows = columns[0].shape[0]
    layer = jnp.broadcast_to(layer_index.astype(jnp.int32), (rows, layer_index.shape[0]))
    return jnp.concatenate([jnp.stack(columns, axis=1).astype(jnp.int32), layer], axis=1)


def kernel_window(sliding_window, layer_ref, index: int = 1):
    """Inside a kernel: its window, read from its layer operand (at ``index``) where it is `TRACED`."""
    return layer_ref[index] if sliding_window is TRACED else sliding_window


def check_window_and_softcap(sliding_window, logit_softcap: float | None):
    """Validates the optional attention variants; returns them as (int | None | i32[], float | None), 0 meaning
    "off" like None (as in ``kernels_cpu``): an int window >= 1 and a finite cap > 0 are the on values. A traced
    window (an integer scalar array; 0: none) is the layer's own, passed as is (`window_in_layer`)."""
    return _check_window(sliding_window), _check_softcap(logit_softcap)


def _check_window(sliding_window):
    if isinstance(sliding_window, jax.Array):
        if sliding_window.shape != () or not jnp.issubdtype(sliding_window.dtype, jnp.integer):
            raise ValueError(f"a traced sliding_window must be an integer scalar, got {sliding_window.dtype}"
                             f"{list(sliding_window.shape)}")
        return sliding_window
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, (int, np.integer)) or sliding_window < 0:
        raise ValueError(f"sliding_window must be an int >= 1 (None or 0: no window), got {sliding_window!r}")
    return int(sliding_window) or None


def _check_softcap(logit_softcap: float | None) -> float | None:
    if logit_softcap is None:
        return None
    if isinstance(logit_softcap, bool) or not isinstance(logit_softcap, (int, float, np.number)) or not (
        0.0 <= logit_softcap < math.inf
    ):
        raise ValueError(f"logit_softcap must be finite and > 0 (None or 0: no soft-cap), got {logit_softcap!r}")
    return float(logit_softcap) or None


def softcap(s: jax.Array, logit_softcap: float | None) -> jax.Array:
    """Scaled scores soft-capped to ``logit_softcap * tanh(s / logit_softcap)`` (Gemma 2); s unchanged for
    None."""
    if logit_softcap is None:
        return s
    return logit_softcap * jnp.tanh(s / logit_softcap)


def logits(q: jax.Array, k: jax.Array, sm_scale: float, logit_softcap: float | None = None, k_scale=None) -> jax.Array:
    """f32[rows, block_tokens] = (q[rows, d] @ k[block_tokens, d].T) * sm_scale, accumulated in float32, times
    the tokens' scales k_scale f32[1, block_tokens] of an int8 block (None: none), then soft-capped
    (``softcap``)."""
    dims = (((1,), (1,)), ((), ()))
    scale = sm_scale if k_scale is None else k_scale * sm_scale
    return softcap(lax.dot_general(q, k, dims, preferred_element_type=jnp.float32) * scale, logit_softcap)


def in_window(mask: jax.Array, key: jax.Array, row_pos: jax.Array, sliding_window: int | None) -> jax.Array:
    """``mask`` limited to the keys of a sliding window of W tokens: row_pos - W < key (the query's own
    position row_pos and the W - 1 before it, with the causal limit key <= row_pos); mask unchanged for
    None."""
    if sliding_window is None:
        return mask
    return mask & (key > row_pos - sliding_window)


def attend_mask(key: jax.Array, row_pos: jax.Array, length, sliding_window: int | None) -> jax.Array:
    """True where the query at row_pos attends the key: causal (key <= row_pos), below ``length`` and in
    the sliding window, if any."""
    return in_window((key <= row_pos) & (key < length), key, row_pos, sliding_window)


def is_static_zero(x) -> bool:
    return isinstance(x, int) and x == 0


def plus(x, offset):
    """x + offset, with no op at all for the static offset 0 (no sliding window): a kernel without a
    window compiles to the same code as before windows existed."""
    return x if is_static_zero(offset) else x + offset


def window_first_page(first_pos, sliding_window: int | None, page_size: int):
    """The page holding the first key that a query at ``first_pos`` (or any later query) may attend under
    the sliding window: pages before it are skipped. The static 0 without a window."""
    if sliding_window is None:
        return 0
    return lax.div(jnp.maximum(first_pos - sliding_window + 1, 0), page_size)


def block_of_page(page, first_page, pages_per_block: int):
    """Index of the compute block (blocks of pages_per_block pages from ``first_page``) that holds ``page``,
    0 if the page comes before them: where a GPU kernel, whose blocks are aligned in the block table, starts
    its walk to skip the pages before a sliding window. The static 0 for the static page 0 (no window)."""
    if is_static_zero(page):
        return 0
    return lax.div(jnp.maximum(page - first_page, 0), pages_per_block)


def blocks_from(first_page, kv_end, page_size: int, pages_per_block: int):
    """Number of compute blocks of pages_per_block pages, from ``first_page`` on, that cover the keys below
    kv_end (0 when first_page is past them)."""
    if is_static_zero(first_page):
        return pl.cdiv(kv_end, pages_per_block * page_size)
    return pl.cdiv(jnp.maximum(pl.cdiv(kv_end, page_size) - first_page, 0), pages_per_block)


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


def kv_values(x: jax.Array, dtype) -> jax.Array:
    """Pages as read from the pool, in the query's dtype (float8 and int8 pages widened; others unchanged)."""
    return x if x.dtype == dtype else x.astype(dtype)


def valid_scales(scales: jax.Array | None, token: jax.Array, kv_end) -> jax.Array | None:
    """Token scales f32[1, n] of an int8 block with those of tokens at or past kv_end (token i32[1, n]) zeroed:
    a scale there may be anything, NaN included. None (no int8 pool) stays None."""
    return None if scales is None else jnp.where(token < kv_end, scales, 0.0)


def split_scale_refs(refs, quantized: bool):
    """(k_scales_ref, v_scales_ref) or (None, None), and the rest: a kernel's refs after the pool's, which
    begin with the scales' refs when the pool is int8 (``quantized``)."""
    return (tuple(refs[:2]), refs[2:]) if quantized else ((None, None), refs)


def gpu_token_scales(scales_ref, pages: jax.Array) -> jax.Array | None:
    """f32[1, pages * page_size] scales of a GPU kernel's block of pages, in token order, from the flattened
    scales ``[num_layers * num_kv_heads * total_pages, page_size]`` (``flat_pages``); None without scales."""
    return None if scales_ref is None else scales_ref[pages].reshape(1, -1)


def gpu_block_scales(k_scales_ref, v_scales_ref, pages: jax.Array):
    """A GPU kernel's block of pages' scales as ``causal_block_step`` takes them (one slice: the plain layout),
    None without scales."""
    if k_scales_ref is None:
        return None
    return tuple([gpu_token_scales(x, pages)] for x in (k_scales_ref, v_scales_ref))


def causal_block_step(
    state, q, k, v, *, first_key, row_pos, length, kv_end, sm_scale, sliding_window=None, logit_softcap=None,
    scales=None,
):
    """Online-softmax update of a query block's rows with one KV block of tokens first_key..: a row attends
    keys at or before its position, below ``length`` and in its sliding window (``attend_mask``), with
    soft-capped logits (``logits``); tokens at or past ``kv_end`` are zeroed in v (and in the scales).

    k, v: [block_rows, lanes] rows of the pool's layout (``PoolGeometry``): with lanes == head_dim a row is
    one token; lane-dense rows hold ``lanes // head_dim`` consecutive tokens, each a slice of head_dim lanes
    that is scored separately (no relayout of the block).
    scales: None, or for an int8 block (k_scales, v_scales), each a list over those slices of f32[1, block_rows]
    scales of the slice's tokens (token first_key + row * tokens_per_row + slice)."""
    head_dim = q.shape[-1]
    tokens_per_row = k.shape[-1] // head_dim
    k, v = kv_values(k, q.dtype), kv_values(v, q.dtype)
    parts = []
    for part in range(tokens_per_row):
        lanes = slice(part * head_dim, (part + 1) * head_dim)
        k_part, v_part = (k, v) if tokens_per_row == 1 else (k[:, lanes], v[:, lanes])
        token_row = first_key + lax.broadcasted_iota(jnp.int32, (1, k.shape[0]), 1) * tokens_per_row + part
        k_scale, v_scale = (None, None) if scales is None else (
            valid_scales(x[part], token_row, kv_end) for x in scales
        )
        s = logits(q, k_part, sm_scale, logit_softcap, k_scale)  # f32[rows, block_rows]
        key = first_key + lax.broadcasted_iota(jnp.int32, s.shape, 1) * tokens_per_row + part
        mask = attend_mask(key, row_pos, length, sliding_window)
        token = first_key + lax.broadcasted_iota(jnp.int32, (k.shape[0], 1), 0) * tokens_per_row + part
        parts.append((s, mask, zero_invalid_rows(v_part, token < kv_end), v_scale))
    return online_softmax_parts(state, parts)


def init_softmax_state(rows: int, head_dim: int, sinks_ref=None):
    """(m f32[rows, 1], l f32[rows, 1], acc f32[rows, head_dim]) before the first KV block; with attention sinks
    (``sinks_ref`` f32[rows, 1], each row's head's sink logit: ``sink_rows``) the softmax starts on its sink, one
    more term of its denominator with no value."""
    if sinks_ref is None:
        m, denom = jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32)
    else:
        m, denom = sinks_ref[...].astype(jnp.float32), jnp.ones((rows, 1), jnp.float32)
    return m, denom, jnp.zeros((rows, head_dim), jnp.float32)


def check_sinks(sinks, num_q_heads: int):
    """``sinks`` (None, or a float logit per query head) as f32[Hq]; a ValueError for another shape or dtype."""
    if sinks is None:
        return None
    if tuple(sinks.shape) != (num_q_heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(f"sinks must be a float [{num_q_heads}] (one logit per query head), got {sinks.dtype}"
                         f"{list(sinks.shape)}")
    return sinks.astype(jnp.float32)


def sink_rows(sinks: jax.Array, num_kv_heads: int, group_p: int, block_q: int) -> jax.Array:
    """f32[Hkv, group_p * block_q, 1]: each kernel row's sink, rows head-major (``block_q`` rows per query head
    of the kv head's group, padded to ``group_p`` heads whose rows are discarded)."""
    heads = sinks.reshape(num_kv_heads, -1)
    heads = jnp.pad(heads, ((0, 0), (0, group_p - heads.shape[1])), constant_values=MASK_VALUE)
    return jnp.repeat(heads, block_q, axis=1)[..., None]


def sink_operands(sinks, num_kv_heads: int, rows: int, block_q: int, index_map) -> tuple[list, list]:
    """([BlockSpec], [f32[Hkv, rows, 1]]) of the sinks of each kernel row (``sink_rows``), or
    ([], []) without sinks."""
    if sinks is None:
        return [], []
    return [pl.BlockSpec((None, rows, 1), index_map)], [sink_rows(sinks, num_kv_heads, rows // block_q, block_q)]


def split_sinks_ref(refs, has_sinks: bool):
    """(the sinks' ref or None, the other refs) of a kernel whose inputs after q start with the sinks' block."""
    return (refs[0], refs[1:]) if has_sinks else (None, refs)


def online_softmax_step(state, s: jax.Array, mask: jax.Array, v: jax.Array, v_scale=None):
    """Folds one KV block into the running (max, sum, unnormalised output) of every query row.

    s: f32[rows, block_tokens] logits; mask: bool[rows, block_tokens] (True = attend);
    v: [block_tokens, head_dim] values with masked-out tokens already zeroed; v_scale: None, or the tokens'
    scales f32[1, block_tokens] of an int8 block (finite: see ``valid_scales``).
    """
    return online_softmax_parts(state, [(s, mask, v, v_scale)])


def online_softmax_parts(state, parts):
    """``online_softmax_step`` over a KV block given as parts (s, mask, v, v_scale), each some of the block's
    tokens: one running max and sum for all of them."""
    m_prev, l_prev, acc_prev = state
    parts = [(jnp.where(mask, s, MASK_VALUE), mask, v, v_scale) for s, mask, v, v_scale in parts]
    m_next = m_prev
    for s, _, _, _ in parts:
        m_next = jnp.maximum(m_next, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    l_next, acc_next = alpha * l_prev, alpha * acc_prev
    for s, mask, v, v_scale in parts:
        p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
        l_next = l_next + jnp.sum(p, axis=1, keepdims=True)
        pv = p if v_scale is None else p * v_scale  # an int8 block: the weights times the tokens' scales
        acc_next = acc_next + jnp.dot(pv.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_next, l_next, acc_next


def finalize(state) -> jax.Array:
    """f32[rows, head_dim] attention output; rows that attended to nothing come out as zeros."""
    _, denom, acc = state
    return acc / jnp.where(denom == 0.0, 1.0, denom)
