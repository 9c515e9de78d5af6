"""The paged KV pool's layout and the writes into it.

The pool is one array per K and V for all layers, `[num_layers, num_kv_heads, num_blocks, rows, lanes]`:
a block of `block_size` tokens is `rows` rows of `lanes` values (`pool_page_shape`). Usually a row is one
token (`rows, lanes = block_size, head_dim`); the Pallas backend's TPU kernels take the lane-dense layout
(`128 // head_dim` tokens per 128-lane row when head_dim < 128): XLA lays out an array whose last dimension
is 64 with another dimension minor, and a Mosaic kernel reads only row-major tiles, so a plain pool of
head_dim 64 would be relaid out (copied whole) at every kernel call. The layers' scan carries the whole
pool and indexes it with the layer number, so `write_kv` updates the donated buffer in place and reads
touch only the pages of the block tables: the step never copies the pool.

`kv_cache_dtype="fp8"` (vLLM's option) keeps K/V as float8 e4m3 with a scale of 1 (vLLM's default when the
checkpoint gives no scales): the values are saturated to +-448 and rounded as they are written, and readers
widen the pages to the query's dtype. Half of bfloat16's bytes, so the same memory holds twice the tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.attention.metadata import AttentionMetadata, slot_mapping


def pool_page_shape(block_size: int, head_dim: int, tokens_per_row: int = 1) -> tuple[int, int]:
    """(rows, lanes) of one block of the pool when a row holds ``tokens_per_row`` tokens."""
    return block_size // tokens_per_row, tokens_per_row * head_dim


def write_kv(
    k_pool: jax.Array,  # [L, Hkv, num_blocks, rows, lanes] (see pool_page_shape)
    v_pool: jax.Array,  # [L, Hkv, num_blocks, rows, lanes]
    layer: jax.Array,  # i32[], the layer whose pages are written
    k: jax.Array,  # [S, Q, Hkv, D]
    v: jax.Array,  # [S, Q, Hkv, D]
    meta: AttentionMetadata,
    *,
    head_windows: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Scatters the step's new K/V into one layer of the pool, in place; padding tokens are dropped.

    ``head_windows`` (the Pallas backend; always for a lane-dense pool): one head_dim-wide window per
    (token, kv head), which TPUs update in place. Otherwise one [kv heads, head_dim] window per token
    (XLA:CPU's fast path)."""
    num_layers, num_kv_heads, num_blocks, rows, lanes = k_pool.shape
    head_dim = k.shape[-1]
    if head_windows or lanes != head_dim:
        return _write_kv_head_windows(k_pool, v_pool, layer, k, v, meta)
    block_size = rows
    num_slots = num_blocks * block_size
    slots = slot_mapping(meta, k.shape[:2], block_size, num_slots)
    if slots.shape[0] == 1:  # XLA turns a one-row scatter into a dynamic-update-slice that copies the pool
        slots = jnp.concatenate([slots, jnp.full((1,), num_slots, jnp.int32)])  # a second row, dropped
        k, v = (jnp.concatenate([x.reshape(1, *x.shape[2:])] * 2) for x in (k, v))

    def scatter(pool: jax.Array, new: jax.Array) -> jax.Array:
        flat = pool.reshape(num_layers, num_kv_heads, num_slots, head_dim)
        new = to_pool_dtype(new.reshape(-1, num_kv_heads, head_dim), pool.dtype)  # [S*Q, Hkv, D], index order
        return flat.at[layer, :, slots].set(new, mode="drop").reshape(pool.shape)

    return scatter(k_pool, k), scatter(v_pool, v)


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


def kv_value_dtype(kv_cache_dtype: str, dtype) -> jnp.dtype:
    """The dtype K/V values are kept in: the model's (``"auto"``) or float8 e4m3 (``"fp8"``, ``"fp8_e4m3"``)."""
    return jnp.dtype(dtype) if kv_cache_dtype == "auto" else FP8_KV_DTYPE


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


def gather_context(pool: jax.Array, layer: jax.Array, block_tables: jax.Array) -> jax.Array:
    """[S, Hkv, P * block_size, D]: one layer's pages of every sequence's block table, in position order."""
    _, num_kv_heads, _, block_size, head_dim = pool.shape
    num_seqs, pages_per_seq = block_tables.shape
    pages = pool_values(pool[layer, :, block_tables])  # one gather: [S, P, Hkv, block_size, D]
    return pages.transpose(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, pages_per_seq * block_size, head_dim)
