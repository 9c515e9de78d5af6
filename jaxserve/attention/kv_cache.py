"""The paged KV pool's layout and the writes into it.

The pool is one array per K and V for all layers, `[num_layers, num_kv_heads, num_blocks, rows, lanes]`:
a block of `block_size` tokens is `rows` rows of `lanes` values (`pool_page_shape`). Usually a row is one
token (`rows, lanes = block_size, head_dim`); the Pallas backend's TPU kernels take the lane-dense layout
(`128 // head_dim` tokens per 128-lane row when head_dim < 128): XLA lays out an array whose last dimension
is 64 with another dimension minor, and a Mosaic kernel reads only row-major tiles, so a plain pool of
head_dim 64 would be relaid out (copied whole) at every kernel call. The layers' scan carries the whole
pool and indexes it with the layer number, so `write_kv` updates the donated buffer in place and reads
touch only the pages of the block tables: the step never copies the pool. `write_kv` is an XLA scatter for the
reference and Pallas backends and the native kernel's custom call for the cpu backend (`KV_WRITES`).

`kv_cache_dtype="fp8"` (vLLM's option) keeps K/V as float8 e4m3 with a scale of 1 (vLLM's default when the
checkpoint gives no scales): the values are saturated to +-448 and rounded as they are written, and readers
widen the pages to the query's dtype. Half of bfloat16's bytes, so the same memory holds twice the tokens.

`kv_cache_dtype="int8"` (vLLM's `int8_per_token_head`) keeps each token's K (and V) row of each kv head as int8
values with a float32 scale of its own, max |x| / 127 of the row, computed as it is written: a K/V pool is then
`ScaledPages(values, scales)`, the int8 pages in the layout above and the scales `[L, Hkv, num_blocks,
block_size]` beside them (token t of block b at `[..., b, t]`, whatever the pages' row layout), written by the
same scatter's slots and read by the same block tables (the reference gather, the native CPU kernel and the
Pallas kernels). 1 + 4 / head_dim bytes per value: 0.53 of bfloat16's at head_dim 64, 0.52 at 128.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.attention.metadata import AttentionMetadata, slot_mapping


class ScaledPages(NamedTuple):
    """An int8 K or V pool (`kv_cache_dtype="int8"`): value of token t of block b = values' row * scales[.., b, t]."""

    values: jax.Array  # int8 [L, Hkv, num_blocks, rows, lanes] (see pool_page_shape)
    scales: jax.Array  # float32 [L, Hkv, num_blocks, block_size], natural token order


def page_values(pool) -> jax.Array:
    """The pages of a K/V pool (an int8 pool's values; any other pool is its pages)."""
    return pool.values if isinstance(pool, ScaledPages) else pool


def pool_of_kinds(pairs) -> tuple:
    """The KV pool of one (K, V) pair per kind of page (`ModelConfig.kv_page_shapes`): the pair itself where there is
    one kind (every model but Gemma 4), else the tuple of pairs."""
    return pairs[0] if len(pairs) == 1 else tuple(pairs)


def kind_pairs(kv_pool, num_kinds: int) -> list:
    """The (K, V) pair of each kind of a pool built by `pool_of_kinds`."""
    return [kv_pool] if num_kinds == 1 else list(kv_pool)


def pool_page_shape(block_size: int, head_dim: int, tokens_per_row: int = 1) -> tuple[int, int]:
    """(rows, lanes) of one block of the pool when a row holds ``tokens_per_row`` tokens."""
    return block_size // tokens_per_row, tokens_per_row * head_dim


KV_WRITES = ("rows", "head_windows", "native")  # how `write_kv` puts the new K/V into the pool


def write_kv(
    k_pool,  # [L, Hkv, num_blocks, rows, lanes] (see pool_page_shape), or ScaledPages of such int8 pages
    v_pool,  # as k_pool
    layer: jax.Array,  # i32[], the layer whose pages are written
    k: jax.Array,  # [S, Q, Hkv, D]
    v: jax.Array,  # [S, Q, Hkv, D]
    meta: AttentionMetadata,
    *,
    writes: str = "rows",
):
    """Puts the step's new K/V into one layer of the pool, in place; padding tokens are dropped. An int8
    pool (`ScaledPages`) gets each row quantized (`quantize_rows`) and its scale written beside it.

    ``writes`` (the backend's `kv_writes`; one of `KV_WRITES`): "rows", one XLA scatter of a [kv heads,
    head_dim] window per token (XLA:CPU's fast path); "head_windows" (the Pallas backend; always for a lane-dense
    pool), one head_dim-wide window per (token, kv head), which TPUs update in place; "native" (the cpu backend),
    the native kernel's custom call (`kernels_cpu.write_kv_rows`), which XLA:CPU does not compile: its scatters
    are kernels of their own, two per layer of an unrolled model, most of a step's compile time."""
    if writes not in KV_WRITES:
        raise ValueError(f"writes must be one of {KV_WRITES}, not {writes!r}")
    if not isinstance(k_pool, ScaledPages):
        return _write_pages(k_pool, v_pool, layer, k, v, meta, writes)
    (k_values, k_scales), (v_values, v_scales) = quantize_rows(k), quantize_rows(v)
    k_pages, v_pages = _write_pages(k_pool.values, v_pool.values, layer, k_values, v_values, meta, writes)
    k_scales, v_scales = _write_scales(k_pool.scales, v_pool.scales, layer, k_scales, v_scales, meta, writes)
    return ScaledPages(k_pages, k_scales), ScaledPages(v_pages, v_scales)


def write_keys(k_pool, layer: jax.Array, k: jax.Array, meta: AttentionMetadata) -> jax.Array:
    """`write_kv` for a pool of keys only (MLA's latent, `ModelConfig.kv_values_in_keys`): ``k`` [S, Q, Hkv, D] into
    one layer of ``k_pool``, one XLA scatter of a row per token, in place (its rows are a token each: D >= 128)."""
    if isinstance(k_pool, ScaledPages):
        raise ValueError("an int8 KV cache keeps no latent (keys-only) pool: use kv_cache_dtype auto or fp8")
    _, _, num_blocks, rows, lanes = k_pool.shape
    if lanes != k.shape[-1]:
        raise ValueError(f"a keys-only pool holds a token per row: {lanes} lanes for keys of {k.shape[-1]}")
    slots, (k,) = _token_slots(meta, k.shape[:2], rows, num_blocks * rows, k)
    return _scatter_slots(k_pool, layer, slots, to_pool_dtype(k, k_pool.dtype))


def _write_pages(k_pool, v_pool, layer, k, v, meta, writes: str):
    _, _, num_blocks, rows, lanes = k_pool.shape
    head_dim = k.shape[-1]
    if writes == "head_windows" or lanes != head_dim:
        return _write_kv_head_windows(k_pool, v_pool, layer, k, v, meta)
    num_slots = num_blocks * rows
    slots, (k, v) = _token_slots(meta, k.shape[:2], rows, num_slots, k, v)
    k, v = to_pool_dtype(k, k_pool.dtype), to_pool_dtype(v, v_pool.dtype)  # [N, Hkv, D], index order
    return _put_rows(k_pool, v_pool, layer, slots, k, v, native=writes == "native")


def _put_rows(k_pool, v_pool, layer, slots: jax.Array, k_rows: jax.Array, v_rows: jax.Array, *, native: bool):
    """(k_pool, v_pool) with rows [N, Hkv, row...] at ``slots`` of ``layer``: the native kernel's custom call, or an
    XLA scatter per pool."""
    if native:
        return _native_write(k_pool, v_pool, layer, k_rows, v_rows, slots)
    return _scatter_slots(k_pool, layer, slots, k_rows), _scatter_slots(v_pool, layer, slots, v_rows)


def _scatter_slots(pool: jax.Array, layer, slots: jax.Array, new: jax.Array) -> jax.Array:
    """``pool`` [L, Hkv, slots..., row...] with ``new`` [N, Hkv, row...] at ``slots`` of ``layer`` (one past the
    pool: dropped), by one XLA scatter over the pool seen as [L, Hkv, num_slots, row...]."""
    num_layers, num_kv_heads = pool.shape[:2]
    flat = pool.reshape(num_layers, num_kv_heads, -1, *new.shape[2:])
    return flat.at[layer, :, slots].set(new, mode="drop").reshape(pool.shape)


def _native_write(k_pool, v_pool, layer, k_rows, v_rows, slots):
    import kernels_cpu

    kernels_cpu.require("the native K/V write's kernel")  # builds and registers it (once per process)
    return kernels_cpu.write_kv_rows(k_pool, v_pool, layer, k_rows, v_rows, slots)


def _write_scales(k_scales, v_scales, layer, new_k, new_v, meta, writes: str):
    """Writes ``new_k`` / ``new_v`` f32[S, Q, Hkv], the step's per-token-per-head scales, into one layer of
    ``k_scales`` / ``v_scales`` [L, Hkv, num_blocks, block_size] at the slots their values went to, in place."""
    num_blocks, block_size = k_scales.shape[2:]
    slots, (new_k, new_v) = _token_slots(meta, new_k.shape[:2], block_size, num_blocks * block_size, new_k, new_v)
    return _put_rows(k_scales, v_scales, layer, slots, new_k[..., None], new_v[..., None], native=writes == "native")


def _token_slots(meta, query_shape, block_size: int, num_slots: int, *per_token: jax.Array):
    """(i32[N] pool slot of each query token, each of ``per_token`` [S, Q, ...] as [N, ...]), N >= 2: XLA turns a
    one-row scatter into a dynamic-update-slice that copies the pool, so a lone token gets a second, dropped row."""
    slots = slot_mapping(meta, query_shape, block_size, num_slots)
    rows = [x.reshape(-1, *x.shape[2:]) for x in per_token]
    if slots.shape[0] == 1:
        slots = jnp.concatenate([slots, jnp.full((1,), num_slots, jnp.int32)])  # the second row is dropped
        rows = [jnp.concatenate([x] * 2) for x in rows]
    return slots, rows


def _write_kv_head_windows(k_pool, v_pool, layer, k, v, meta):
    """write_kv as one scatter of head_dim-wide windows, one per (token, kv head), into any pool layout: token
    t of a block goes to row t // r, lanes (t % r) * D onwards (r tokens per row). On TPU this keeps the
    pool's row-major layout and updates it in place; a window spanning the kv heads made XLA pick a
    heads-minor layout for the scatter loop and relay out the whole pool around every kernel call."""
    num_layers, num_kv_heads, num_blocks, rows, lanes = k_pool.shape
    head_dim = k.shape[-1]
    tokens_per_row = lanes // head_dim
    block_size = rows * tokens_per_row
    slots = slot_mapping(meta, k.shape[:2], block_size, num_blocks * block_size)  # padding: past the pool
    block, offset = slots // block_size, slots % block_size
    grid = (slots.shape[0], num_kv_heads)  # (token, kv head), token-major like the values
    per_token = lambda x: jnp.broadcast_to(x[:, None], grid)
    indices = jnp.stack([
        jnp.broadcast_to(layer, grid),
        jnp.broadcast_to(jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :], grid),
        per_token(block),
        per_token(offset // tokens_per_row),  # row
        per_token((offset % tokens_per_row) * head_dim),  # first lane
    ], axis=-1).reshape(-1, 5)  # i32[N * Hkv, 5]: layer, head, block, row, first lane
    numbers = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(1,), inserted_window_dims=(0, 1, 2, 3), scatter_dims_to_operand_dims=(0, 1, 2, 3, 4)
    )

    def scatter(pool: jax.Array, new: jax.Array) -> jax.Array:
        new = to_pool_dtype(new.reshape(-1, head_dim), pool.dtype)  # [N * Hkv, D]
        return jax.lax.scatter(
            pool, indices, new, numbers, indices_are_sorted=False, unique_indices=False,
            mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
        )

    return scatter(k_pool, k), scatter(v_pool, v)


FP8_KV_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_KV_MAX = float(jnp.finfo(FP8_KV_DTYPE).max)  # 448: larger K/V values are saturated, as vLLM's cache writes do
# integer storage of a 16- and an 8-bit float on XLA:CPU (see kv_storage_dtype), and the float each holds
_BITS_OF = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16), FP8_KV_DTYPE: jnp.dtype(jnp.uint8)}
_FLOAT_OF = {bits: value for value, bits in _BITS_OF.items()}


INT8_KV_DTYPE = jnp.dtype(jnp.int8)
INT8_KV_MAX = 127  # a row's largest |value| is stored as +-127; the scale is max |x| / 127
SCALE_BYTES = 4  # an int8 pool's scale per token and kv head: one float32


def kv_value_dtype(kv_cache_dtype: str, dtype) -> jnp.dtype:
    """The dtype K/V values are kept in: the model's (``"auto"``), float8 e4m3 (``"fp8"``, ``"fp8_e4m3"``) or int8
    with a scale per token and kv head (``"int8"``, ``"int8_per_token_head"``)."""
    if kv_cache_dtype == "auto":
        return jnp.dtype(dtype)
    return INT8_KV_DTYPE if kv_cache_dtype.startswith("int8") else FP8_KV_DTYPE


def kv_scale_bytes(kv_dtype) -> int:
    """Bytes a pool of ``kv_dtype`` keeps beside each token's row of each kv head: int8's float32 scale, else 0."""
    return SCALE_BYTES if jnp.dtype(kv_dtype) == INT8_KV_DTYPE else 0


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(int8 [..., D], f32[...]): each row of x [..., D] as round(x / scale) with scale = max |x| / 127 (rounded
    to nearest even; a row of zeros gets scale 0 and zeros)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / INT8_KV_MAX
    values = jnp.round(x / jnp.where(scale == 0.0, 1.0, scale)[..., None])
    return jnp.clip(values, -INT8_KV_MAX, INT8_KV_MAX).astype(INT8_KV_DTYPE), scale


def kv_storage_dtype(kv_dtype, platform: str) -> jnp.dtype:
    """The dtype the pool is stored in for K/V values of ``kv_dtype``. On XLA:CPU a bfloat16 (float8) pool is
    stored as its raw bits, uint16 (uint8): XLA:CPU has no bfloat16 scatter, and rewrites the K/V write into a
    bf16 pool as a float32 scatter into a converted copy of the whole pool (every layer's pages, every layer,
    every step), while an integer scatter updates the donated pool in place. Readers widen pages with
    `pool_values`."""
    kv_dtype = jnp.dtype(kv_dtype)
    return _BITS_OF.get(kv_dtype, kv_dtype) if platform == "cpu" else kv_dtype


def to_pool_dtype(values: jax.Array, pool_dtype) -> jax.Array:
    """K/V values as the pool stores them: float8 saturated to +-448 and rounded to nearest even, bfloat16 and
    float8 as their bits in a uint16 / uint8 pool."""
    value_dtype = _FLOAT_OF.get(jnp.dtype(pool_dtype), jnp.dtype(pool_dtype))
    if value_dtype == FP8_KV_DTYPE:
        values = jnp.clip(values, -FP8_KV_MAX, FP8_KV_MAX)
    values = values.astype(value_dtype)
    return values if value_dtype == pool_dtype else jax.lax.bitcast_convert_type(values, pool_dtype)


def pool_values(pages: jax.Array) -> jax.Array:
    """Pages read from the pool as K/V values (uint16 storage is bfloat16 bits, uint8 float8 e4m3 bits)."""
    value_dtype = _FLOAT_OF.get(pages.dtype)
    return pages if value_dtype is None else jax.lax.bitcast_convert_type(pages, value_dtype)


def gather_context(pool, layer: jax.Array, block_tables: jax.Array) -> jax.Array:
    """[S, Hkv, P * block_size, D]: one layer's pages of every sequence's block table, in position order (an int8
    pool's values times their scales, in float32)."""
    if isinstance(pool, ScaledPages):
        scales = _in_position_order(pool.scales[layer, :, block_tables][..., None])  # [S, Hkv, T, 1]
        return _in_position_order(pool.values[layer, :, block_tables]).astype(jnp.float32) * scales
    return _in_position_order(pool_values(pool[layer, :, block_tables]))


def _in_position_order(pages: jax.Array) -> jax.Array:
    """Gathered pages [S, P, Hkv, block_size, D] as [S, Hkv, P * block_size, D]."""
    num_seqs, pages_per_seq, num_kv_heads, block_size, head_dim = pages.shape
    return pages.transpose(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, pages_per_seq * block_size, head_dim)
