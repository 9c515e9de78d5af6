"""Attention over the paged KV pool: batch metadata, K/V writes, and the backend registry.

The model calls `write_kv` to scatter a step's new keys and values into its layer of the pool, then
`backend.attend(...)` to attend each query token over its sequence's cached context. A step's tokens are
laid out padded (`[S, Q]`: prefill and decode buckets) or ragged (`[1, T]`: a mixed step of decode rows
and prefill chunks); `AttentionMetadata` says which and `token_layout` maps every query slot to its row
and position. Backends: "reference" (plain XLA, gathers pages through the block table), "pallas" (the
kernels in `kernels_pallas`, imported lazily) and "cpu" (the native XLA:CPU kernel of `kernels_cpu`,
ragged itself; the default on CPU).

The pool is one array per K and V for all layers, `[num_layers, num_kv_heads, num_blocks, rows, lanes]`:
a block of `block_size` tokens is `rows` rows of `lanes` values (`pool_page_shape`). Usually a row is one
token (`rows, lanes = block_size, head_dim`); the Pallas backend's TPU kernels take the lane-dense layout
(`128 // head_dim` tokens per 128-lane row when head_dim < 128): XLA lays out an array whose last dimension
is 64 with another dimension minor, and a Mosaic kernel reads only row-major tiles, so a plain pool of
head_dim 64 would be relaid out (copied whole) at every kernel call. The layers' scan carries the whole
pool and indexes it with the layer number, so writes update the donated buffer in place and reads touch
only the pages of the block tables (the kernels read the stacked pool at the layer index): the step never
copies the pool.
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import struct

from jaxserve.logger import init_logger

logger = init_logger("jaxserve.attention.backends")


@struct.dataclass
class AttentionMetadata:
    """Per-step batch layout, passed into the jitted step as an explicit pytree.

    Padded layout (``query_starts`` None): a batch of `S` rows with `Q` query tokens each (Q == 1 for
    decode), the model's input `[S, Q]`. Query token `i` of row `s` sits at position `q_start[s] + i`;
    tokens at positions `>= lengths[s]` are padding (not written to the pool, their outputs are garbage).

    Ragged layout (``query_starts`` given, a mixed step): the model's input is `[1, T]`, every row's query
    tokens back to back; row `s` is the `lengths[s] - q_start[s]` tokens from flat index `query_starts[s]`
    (non-decreasing; padding rows have no tokens: `q_start = lengths = 0`), at positions `q_start[s]`
    onwards. Flat tokens past every row are padding.
    """

    block_tables: jax.Array  # i32[S, pages_per_seq]
    q_start: jax.Array  # i32[S], position of each sequence's first query token
    lengths: jax.Array  # i32[S], context length after this step (q_start + real query tokens)
    query_starts: jax.Array | None = None  # i32[S], ragged layout only: flat index of each row's first token

    @property
    def is_ragged(self) -> bool:
        return self.query_starts is not None

    @property
    def query_lens(self) -> jax.Array:
        """i32[S]: each row's real query tokens (0 for padding rows)."""
        return jnp.maximum(self.lengths - self.q_start, 0)


@struct.dataclass
class TokenLayout:
    """Where every query slot of a step's input (`[S, Q]` or `[1, T]`) belongs: arrays of the input's shape."""

    rows: jax.Array  # i32: the row (sequence) of the slot
    positions: jax.Array  # i32: its position in that sequence
    valid: jax.Array  # bool: a real token (False: padding)


def token_positions(q_start: jax.Array, num_query_tokens: int) -> jax.Array:
    """i32[S, Q]: the position of every query slot of the padded batch."""
    return q_start[:, None] + jnp.arange(num_query_tokens, dtype=jnp.int32)[None, :]


def token_layout(meta: AttentionMetadata, query_shape: tuple[int, int]) -> TokenLayout:
    """The row, position and validity of every slot of an input of ``query_shape`` laid out as ``meta`` says."""
    if not meta.is_ragged:
        num_rows, num_query = query_shape
        positions = token_positions(meta.q_start, num_query)
        rows = jnp.broadcast_to(jnp.arange(num_rows, dtype=jnp.int32)[:, None], query_shape)
        return TokenLayout(rows, positions, positions < meta.lengths[:, None])
    flat = jnp.arange(query_shape[1], dtype=jnp.int32)
    rows = jnp.sum(flat[:, None] >= meta.query_starts[None, :], axis=1, dtype=jnp.int32) - 1
    rows = jnp.maximum(rows, 0)
    positions = meta.q_start[rows] + flat - meta.query_starts[rows]
    valid = positions < meta.lengths[rows]
    return TokenLayout(*(x.reshape(query_shape) for x in (rows, positions, valid)))


def row_offsets(meta: AttentionMetadata, query_shape: tuple[int, int]) -> jax.Array:
    """i32[S]: the flat index (in the input reshaped to one dimension) of each row's first query slot."""
    if meta.is_ragged:
        return meta.query_starts
    num_rows, num_query = query_shape
    return jnp.arange(num_rows, dtype=jnp.int32) * num_query


def slot_mapping(meta: AttentionMetadata, query_shape: tuple[int, int], block_size: int, num_slots: int) -> jax.Array:
    """i32[N]: flat pool slot of each query slot (flattened); padding maps to `num_slots` (dropped)."""
    layout = token_layout(meta, query_shape)
    tables = meta.block_tables[layout.rows]  # [..., pages_per_seq]
    block_idx = jnp.take_along_axis(tables, (layout.positions // block_size)[..., None], axis=-1, mode="clip")[..., 0]
    slots = block_idx * block_size + layout.positions % block_size
    return jnp.where(layout.valid, slots, num_slots).reshape(-1)


def per_token_rows(meta: AttentionMetadata, query_shape: tuple[int, int]) -> AttentionMetadata:
    """Padded metadata with every query slot as its own one-token row (`[N, 1]`): a token at position p is a
    decode row of length p + 1 with its sequence's block table, which is exactly causal attention. Lets a
    decode-only attention serve a ragged step (more page reads than a ragged kernel: one row per token)."""
    layout = token_layout(meta, query_shape)
    rows, positions, valid = (x.reshape(-1) for x in (layout.rows, layout.positions, layout.valid))
    lengths = jnp.where(valid, positions + 1, 0)
    return AttentionMetadata(meta.block_tables[rows], jnp.where(valid, positions, 0), lengths)


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


def kv_storage_dtype(kv_dtype, platform: str) -> jnp.dtype:
    """The dtype the pool is stored in for K/V values of ``kv_dtype``. On XLA:CPU a bfloat16 pool is stored as
    its raw bits (uint16): XLA:CPU has no bfloat16 scatter, and rewrites the K/V write into a bf16 pool as a
    float32 scatter into a converted copy of the whole pool (every layer's pages, every layer, every step),
    while an integer scatter updates the donated pool in place. Readers widen pages with `pool_values`."""
    kv_dtype = jnp.dtype(kv_dtype)
    return jnp.dtype(jnp.uint16) if platform == "cpu" and kv_dtype == jnp.bfloat16 else kv_dtype


def to_pool_dtype(values: jax.Array, pool_dtype) -> jax.Array:
    """K/V values as the pool stores them (bfloat16 bits for a uint16 pool)."""
    if pool_dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(values.astype(jnp.bfloat16), jnp.uint16)
    return values.astype(pool_dtype)


def pool_values(pages: jax.Array) -> jax.Array:
    """Pages read from the pool as K/V values (uint16 storage is bfloat16 bits)."""
    return jax.lax.bitcast_convert_type(pages, jnp.bfloat16) if pages.dtype == jnp.uint16 else pages


def gather_context(pool: jax.Array, layer: jax.Array, block_tables: jax.Array) -> jax.Array:
    """[S, Hkv, P * block_size, D]: one layer's pages of every sequence's block table, in position order."""
    _, num_kv_heads, _, block_size, head_dim = pool.shape
    num_seqs, pages_per_seq = block_tables.shape
    pages = pool_values(pool[layer, :, block_tables])  # one gather: [S, P, Hkv, block_size, D]
    return pages.transpose(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, pages_per_seq * block_size, head_dim)


class AttentionBackend(Protocol):
    name: str

    head_window_writes: bool  # how write_kv scatters into the pool for it

    def tokens_per_row(self, block_size: int, head_dim: int) -> int: ...  # of the pool layout it reads

    def attend(
        self,
        q: jax.Array,  # [S, Q, Hq, D] (a ragged step: [1, T, Hq, D])
        k_pool: jax.Array,  # [L, Hkv, num_blocks, block_size, D]
        v_pool: jax.Array,  # [L, Hkv, num_blocks, block_size, D]
        layer: jax.Array,  # i32[]
        meta: AttentionMetadata,
        *,
        sm_scale: float,
        sliding_window: int | None,
    ) -> jax.Array: ...  # q's shape


class ReferenceBackend:
    """Plain XLA paged attention: an online-softmax loop over chunks of each block table.

    The loop runs only as far as the longest sequence of its group of rows (a dynamic trip count), so a
    decode step on a 2048-token context bucket whose sequences hold 200 tokens reads about 200 tokens per
    sequence, not 2048. Large decode batches are split into groups of `group_rows` rows, each looping to
    its own longest sequence; the engine orders decode rows by length so that groups are homogeneous.
    Each chunk gathers `chunk_pages` pages of one layer straight from the stacked pool.
    """

    name = "reference"
    head_window_writes = False  # write_kv's layout of the scatter (see write_kv)

    def __init__(self, chunk_tokens: int = 256, group_rows: int = 8):
        self.chunk_tokens = chunk_tokens
        self.group_rows = group_rows

    def tokens_per_row(self, block_size: int, head_dim: int) -> int:
        return 1

    def attend(self, q, k_pool, v_pool, layer, meta, *, sm_scale, sliding_window=None):
        block_size = k_pool.shape[3]
        chunk_pages = max(1, min(self.chunk_tokens // block_size, meta.block_tables.shape[1]))
        attend_rows = lambda q, meta: chunked_paged_attention(
            q, k_pool, v_pool, layer, meta, chunk_pages=chunk_pages,
            sm_scale=sm_scale, sliding_window=sliding_window,
        )
        if meta.is_ragged:  # every token as a decode row of its sequence (see per_token_rows)
            tokens = q.reshape(-1, 1, *q.shape[2:])
            return attend_rows(tokens, per_token_rows(meta, q.shape[:2])).reshape(q.shape)
        num_seqs = q.shape[0]
        if q.shape[1] > 1 or num_seqs < 2 * self.group_rows:
            return attend_rows(q, meta)
        groups = [slice(start, start + self.group_rows) for start in range(0, num_seqs, self.group_rows)]
        outs = [attend_rows(q[rows], jax.tree.map(lambda x, rows=rows: x[rows], meta)) for rows in groups]
        return jnp.concatenate(outs, axis=0)


def chunked_paged_attention(q, k_pool, v_pool, layer, meta, *, chunk_pages, sm_scale, sliding_window=None):
    """q [S, Q, Hq, D] attends causally over its sequence's pages; returns [S, Q, Hq, D] (padding rows 0)."""
    num_seqs, num_q, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_pool.shape[1], k_pool.shape[3]
    chunk_len = chunk_pages * block_size
    pages_per_seq = meta.block_tables.shape[1]
    padded_pages = -(-pages_per_seq // chunk_pages) * chunk_pages
    block_tables = jnp.pad(meta.block_tables, ((0, 0), (0, padded_pages - pages_per_seq)))
    qg = q.astype(jnp.float32).reshape(num_seqs, num_q, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    rows = token_positions(meta.q_start, num_q)[:, None, None, :, None]  # [S, 1, 1, Q, 1]
    lengths = meta.lengths[:, None, None, None, None]

    def chunk(i, state):
        m, denom, acc = state
        pages = jax.lax.dynamic_slice_in_dim(block_tables, i * chunk_pages, chunk_pages, axis=1)
        k = gather_context(k_pool, layer, pages).astype(jnp.float32)  # [S, Hkv, T, D]
        v = gather_context(v_pool, layer, pages).astype(jnp.float32)
        keys = i * chunk_len + jnp.arange(chunk_len)[None, None, None, None, :]  # [1, 1, 1, 1, T]
        mask = (keys <= rows) & (keys < lengths)
        if sliding_window is not None:
            mask &= keys > rows - sliding_window
        scores = jnp.einsum("sqhgd,shtd->shgqt", qg, k) * sm_scale
        scores = jnp.where(mask, scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(scores - m_safe[..., None])
        scale = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        v = jnp.where(keys[0, 0, 0, 0][None, None, :, None] < meta.lengths[:, None, None, None], v, 0.0)
        acc = acc * scale[..., None] + jnp.einsum("shgqt,shtd->shgqd", p, v)
        return m_new, denom * scale + p.sum(axis=-1), acc

    group = num_q_heads // num_kv_heads
    init = (
        jnp.full((num_seqs, num_kv_heads, group, num_q), -jnp.inf, jnp.float32),
        jnp.zeros((num_seqs, num_kv_heads, group, num_q), jnp.float32),
        jnp.zeros((num_seqs, num_kv_heads, group, num_q, head_dim), jnp.float32),
    )
    num_chunks = (jnp.max(meta.lengths) + chunk_len - 1) // chunk_len
    _, denom, acc = jax.lax.fori_loop(0, num_chunks, chunk, init)
    out = acc / jnp.maximum(denom, 1e-30)[..., None]  # [S, Hkv, G, Q, D]
    out = out.transpose(0, 3, 1, 2, 4).reshape(q.shape)
    valid = token_positions(meta.q_start, num_q) < meta.lengths[:, None]
    return jnp.where(valid[..., None, None], out, 0.0).astype(q.dtype)


class PallasBackend:
    """The Pallas kernels: `paged_attention` for decode (Q == 1), `prefill_attention` for prefill chunks and
    `ragged_paged_attention` for mixed steps. They read the stacked pool in place at the layer index.

    ``platform`` is where the step runs: "tpu" (Mosaic kernels, lane-dense pool), "gpu"/"cuda"/"rocm"
    (Triton kernels), or "cpu", where the TPU variant runs in the Pallas interpreter (tests)."""

    name = "pallas"
    head_window_writes = True

    def __init__(self, platform: str):
        from kernels_pallas._common import GPU_PLATFORMS

        self.platform = platform
        self.kernel_variant = "gpu" if platform in GPU_PLATFORMS else "tpu"
        self.interpret = platform != "tpu" and platform not in GPU_PLATFORMS

    def tokens_per_row(self, block_size: int, head_dim: int) -> int:
        if self.kernel_variant != "tpu":
            return 1
        from kernels_pallas._common import lane_dense_tokens_per_row

        return lane_dense_tokens_per_row(block_size, head_dim)

    def attend(self, q, k_pool, v_pool, layer, meta, *, sm_scale, sliding_window=None):
        import kernels_pallas

        if sliding_window is not None:
            raise ValueError("the pallas attention backend does not support sliding-window attention")
        # uint16 pools (bfloat16 bits) exist only on XLA:CPU, where the kernels run interpreted
        k_pool, v_pool = pool_values(k_pool), pool_values(v_pool)
        common = dict(layer=layer, sm_scale=sm_scale, interpret=self.interpret, backend=self.kernel_variant)
        query = q.astype(k_pool.dtype)  # the kernels take q in the pool's dtype
        if meta.is_ragged:  # a mixed step ([1, T] tokens of ragged rows): the ragged kernel over the flat tokens
            out = kernels_pallas.ragged_paged_attention(
                query[0], k_pool, v_pool, meta.block_tables, meta.query_starts, meta.query_lens, meta.q_start,
                meta.lengths, **common,
            )[None]
        elif q.shape[1] == 1:
            lengths = jnp.maximum(meta.lengths, 1)  # padding rows (length 0) read one harmless slot
            out = kernels_pallas.paged_attention(query[:, 0], k_pool, v_pool, lengths, meta.block_tables, **common)
            out = out[:, None]
        else:
            out = kernels_pallas.prefill_attention(
                query, k_pool, v_pool, meta.block_tables, meta.q_start, meta.lengths, **common
            )
        return out.astype(q.dtype)


class CpuBackend(ReferenceBackend):
    """XLA:CPU: decode steps and prefill chunks call the native kernel of `kernels_cpu`, which reads the pages
    in place (plain XLA first copies every page through a slow gather) and attends only up to each token's
    position, when the pool is float32 or bfloat16 (or its uint16 bits); pools of other dtypes take the
    plain-XLA path of `ReferenceBackend`."""

    name = "cpu"

    def __init__(self, **chunking):
        import kernels_cpu

        super().__init__(**chunking)
        if kernels_cpu.load() is None:  # builds and registers the kernel (once per process)
            raise RuntimeError(f"the cpu attention backend's kernel could not be built: {kernels_cpu.build_error()}")

    def attend(self, q, k_pool, v_pool, layer, meta, *, sm_scale, sliding_window=None):
        import kernels_cpu

        if k_pool.dtype not in kernels_cpu.POOL_DTYPES or v_pool.dtype != k_pool.dtype:
            return super().attend(q, k_pool, v_pool, layer, meta, sm_scale=sm_scale, sliding_window=sliding_window)
        if meta.is_ragged:
            out = kernels_cpu.paged_attention(
                q[0], k_pool, v_pool, layer, meta.block_tables, meta.query_starts, meta.query_lens, meta.q_start,
                meta.lengths,
                sm_scale=sm_scale, sliding_window=sliding_window,
            )[None]
        else:
            out = kernels_cpu.padded_paged_attention(
                q, k_pool, v_pool, layer, meta.block_tables, meta.q_start, meta.lengths,
                sm_scale=sm_scale, sliding_window=sliding_window,
            )
        return out.astype(q.dtype)


ATTENTION_BACKENDS = ("reference", "pallas", "cpu")


def _cpu_kernel_available() -> bool:
    import kernels_cpu

    if kernels_cpu.load() is not None:
        return True
    logger.warning("the native CPU attention kernel is unavailable (%s); using plain XLA", kernels_cpu.build_error())
    return False


@functools.cache
def get_attention_backend(name: str, platform: str | None = None) -> AttentionBackend:
    """Backend by name for steps that run on ``platform`` (default: JAX's default backend); "auto" is pallas
    on GPU/TPU, and on CPU the native kernel ("cpu") when it builds, else plain XLA ("reference")."""
    platform = platform or jax.default_backend()
    if name == "auto":
        if platform != "cpu":
            name = "pallas"
        else:
            name = "cpu" if _cpu_kernel_available() else "reference"
    if name == "reference":
        return ReferenceBackend()
    if name == "pallas":
        return PallasBackend(platform)
    if name == "cpu":
        return CpuBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of: auto, {', '.join(ATTENTION_BACKENDS)}")
