"""Ragged paged attention: decode rows (one query token) and prefill chunks (many) in one flat batch.

Place in the data flow: for a "mixed" engine step the attention backend writes the step's K/V into the
pool, then calls ``ragged_paged_attention`` once per layer with the stacked KV pool and the layer index
(read in place) and the step's rows. It is the accelerator counterpart of the
native CPU kernel (``kernels_cpu.paged_attention``) and has the same semantics:

Row s is ``query_lens[s]`` tokens of q from ``query_starts[s]``; its token i sits at position
``positions[s] + i`` and attends causally over its sequence's cached tokens at positions <= its own and
< ``lengths[s]``. Tokens at positions outside [0, lengths[s]), tokens of q that belong to no row, and rows
of 0 tokens give zeros. ``lengths`` above pages_per_seq * page_size are clamped to it; block-table entries
past what a row sees are never dereferenced, and out-of-range entries below it are clamped into the pool
(as XLA clamps gather indices). The rows' query ranges must lie inside q and must not overlap (the CPU
kernel raises otherwise; here tokens outside q are dropped, and a token in two rows gets one of them).

Optional variants: ``sliding_window`` W (static, or traced: the layer's own, carried in the layer
operand) further limits a token at position p to keys p - W < k;
``logit_softcap`` c replaces the scaled scores s by c * tanh(s / c) before masking and the softmax.

Over the int8 KV cache (``k_scales`` / ``v_scales``: a float32 scale per token and kv head, written by the
engine with the int8 values) the pages are widened to q's dtype and the scales applied to the scores and
the softmax weights, as in ``paged_attention`` (``_common``; the TPU variant gathers the scales of each
row's block table once per call, ``_tpu_paging``).

Work items. The wrapper (plain jnp, inside the same jit) cuts every row into items of at most ``block_q``
consecutive tokens of that one row: row s gives cdiv(query_lens[s], block_q) items. An item never
straddles rows, so the kernel body is the plain one-sequence causal block of the prefill kernel, with one
block table, one length and one position range. Items are numbered row by row, item w belonging to the
row whose running item count first exceeds w (a ``searchsorted``). Their number is data-dependent, so
the grid takes the static bound

    num_items = (num_tokens + num_rows * (block_q - 1)) // block_q

(sum_s cdiv(n_s, B) <= (sum_s n_s + S (B - 1)) / B and sum_s n_s <= num_tokens for rows inside q that do
not overlap). An all-decode step (num_tokens == num_rows) gets exactly num_rows items; the unused items
at the end have no tokens, copy no pages and write nothing. The wrapper gathers each item's tokens from q
into a padded [items, kv heads, group * block_q, head_dim] block (rows head-major: row = head * block_q
+ token, so one K/V page read serves every query head of the group) and scatters the items' outputs
back to their tokens. That is a copy of q and of the output, never of the KV cache.

Per item the kernel needs three scalars, computed by the wrapper: its row (for the block table), the
position of its first token, and ``kv_end``, the exclusive key limit
min(lengths[row], last token's position + 1) (0 for an empty item). A token of the item is real exactly
when 0 <= its position < kv_end, and it attends keys k <= its position (and < kv_end, and in its window).

Two Pallas variants, both on grid (kv head, item) with a float32 online softmax over blocks of
``pages_per_compute_block`` pages, walking the item's pages only up to kv_end and, with a sliding window,
only from the page holding the window start of the item's first token (the GPU variant: from the compute
block holding that page):
* TPU (Mosaic): the items' rows, first positions, kv_end and the (flattened) block tables are
  scalar-prefetched into SMEM; pages stay in HBM and are DMA'd into double-buffered VMEM slots
  (``_tpu_paging``). On CPU it runs in the TPU interpreter (``interpret=True``).
* GPU (Triton): each program gathers its item's pages through the item's block table (the wrapper hands
  every item its row's table, an [items, pages_per_seq] int gather) and reads them from the pool in HBM.

Cost trade-off of fixed-size items: every item of a prefill chunk streams its row's context up to its own
last token, so a chunk of n tokens reads the context about n / block_q times (per kv head); a decode row
fills 1 of the item's block_q token slots (free on the TPU MXU while group * block_q <= 128, and the step
is bound by the page reads anyway). ``block_q`` is the knob between the two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import _common as cm
from kernels_pallas._tpu_paging import fold_pages, open_stream, stream_operands
from kernels_pallas.paged_attention import gather_pages

# Knobs per backend, the KV block sized to ~128 tokens; starting points, not yet measured on hardware.
TUNED_BLOCK_SIZES: dict[tuple[str, int, int], dict[str, int]] = {
    **{
        ("tpu", page_size, head_dim): {"block_q": 16, "pages_per_compute_block": max(1, 128 // page_size)}
        for page_size in cm.SUPPORTED_PAGE_SIZES
        for head_dim in cm.SUPPORTED_HEAD_DIMS
    },
    **{
        ("gpu", page_size, head_dim): {
            "block_q": 16,
            "pages_per_compute_block": max(1, 64 // page_size),
            "num_warps": 4 if head_dim <= 128 else 8,
            "num_stages": 2,
        }
        for page_size in cm.SUPPORTED_PAGE_SIZES
        for head_dim in cm.SUPPORTED_HEAD_DIMS
    },
}
DEFAULT_BLOCK_SIZES = {
    "tpu": {"block_q": 16, "pages_per_compute_block": 2},
    "gpu": {"block_q": 16, "pages_per_compute_block": 1, "num_warps": 4, "num_stages": 2},
}
MIN_GPU_ROWS = 16  # Triton dots need >= 16 rows: the GPU variant pads the query-head group up to it


# ------------------------------------------------------------------------------------------ items


class _Items:
    """The work list: item w is tokens first_token[w].. (at most block_q) of row rows[w]."""

    def __init__(self, query_starts, query_lens, positions, lengths, *, num_tokens, block_q, num_items):
        num_rows = query_lens.shape[0]
        query_lens = jnp.clip(query_lens, 0, num_tokens)
        per_row = pl.cdiv(query_lens, block_q)  # items of each row
        ends = jnp.cumsum(per_row)  # items of rows 0..s
        item = jnp.arange(num_items, dtype=jnp.int32)
        # num_rows past the last item; every pair compared (one fusion): the default bisection is a while loop of
        # four kernels a round, which XLA:GPU ran in every layer of a mixed step (docs/benchmarks/gpu.md)
        row = jnp.searchsorted(ends, item, side="right", method="compare_all").astype(jnp.int32)
        live = row < num_rows
        row = jnp.where(live, row, 0)
        first_token = (item - (ends[row] - per_row[row])) * block_q  # within the row
        count = jnp.where(live, jnp.clip(query_lens[row] - first_token, 0, block_q), 0)
        first_pos = positions[row] + first_token
        self.rows = row  # i32[items]
        self.first_pos = jnp.where(live, first_pos, 0)  # i32[items], position of the item's first token
        # exclusive key limit: the last token's position + 1, at most the row's length; 0 if no token is real
        self.kv_end = jnp.where(live, jnp.clip(jnp.minimum(lengths[row], first_pos + count), 0, None), 0)
        slot = jnp.arange(block_q, dtype=jnp.int32)[None, :]
        token = query_starts[row][:, None] + first_token[:, None] + slot  # i32[items, block_q], index in q
        in_q = (slot < count[:, None]) & (token >= 0) & (token < num_tokens)
        self.token = jnp.where(in_q, token, num_tokens)  # num_tokens = no token (dropped by the scatter)


def _gather_items(q, items: _Items, num_kv_heads: int, group_p: int, block_q: int) -> jax.Array:
    """q [T, Hq, D] -> [items, kvh, group_p * block_q, D]: the items' tokens, zeros where an item has none,
    rows head-major within an item."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    x = jnp.take(q, items.token, axis=0, mode="fill", fill_value=0)  # [items, block_q, Hq, D]
    num_items = x.shape[0]
    x = x.reshape(num_items, block_q, num_kv_heads, group, head_dim)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, group_p - group), (0, 0)))
    x = x.transpose(0, 2, 3, 1, 4)  # [items, kvh, group_p, block_q, D]
    return x.reshape(num_items, num_kv_heads, group_p * block_q, head_dim)


def _scatter_items(x, items: _Items, q_shape, group_p: int, block_q: int) -> jax.Array:
    """Inverse of ``_gather_items``: [items, kvh, group_p * block_q, D] -> [T, Hq, D], zeros for tokens in
    no item."""
    num_tokens, num_q_heads, head_dim = q_shape
    num_items, num_kv_heads = x.shape[:2]
    group = num_q_heads // num_kv_heads
    x = x.reshape(num_items, num_kv_heads, group_p, block_q, head_dim)[:, :, :group]
    x = x.transpose(0, 3, 1, 2, 4).reshape(num_items * block_q, num_q_heads, head_dim)
    out = jnp.zeros(q_shape, x.dtype)
    return out.at[items.token.reshape(-1)].set(x, mode="drop")


# --------------------------------------------------------------------------------------------- TPU


def _tpu_kernel(
    rows_ref,  # SMEM i32[items], each item's row
    first_pos_ref,  # SMEM i32[items], position of each item's first token
    kv_end_ref,  # SMEM i32[items], exclusive key limit
    table_ref,  # SMEM i32[num_rows * pages_per_seq], flattened block tables
    layer_ref,  # SMEM i32[1], or i32[2] [layer, window] with a traced window
    q_ref,  # VMEM [group * block_q, head_dim]
    *refs,  # with sinks their VMEM f32[group * block_q, 1] first; the pool's (``_tpu_paging.open_stream``), o_ref
    sm_scale: float,
    pages_per_seq: int,
    page_size: int,
    block_q: int,
    quantized: bool,
    sliding_window: int | None,
    logit_softcap: float | None,
    has_sinks: bool,
):
    sinks_ref, refs = cm.split_sinks_ref(refs, has_sinks)
    head, item = pl.program_id(0), pl.program_id(1)
    kv_end = kv_end_ref[item]
    sliding_window = cm.kernel_window(sliding_window, layer_ref)
    rows, head_dim = q_ref.shape
    first_pos = first_pos_ref[item]
    row_pos = cm.row_positions(first_pos, rows, block_q)
    first_page = cm.window_first_page(first_pos, sliding_window, page_size)
    real = (row_pos >= 0) & (row_pos < kv_end)  # [rows, 1]: a token of the row with something to attend
    stream, o_ref = open_stream(
        refs, quantized=quantized, table_ref=table_ref, table_row=rows_ref[item], pages_per_seq=pages_per_seq,
        layer=layer_ref[0], head=head, num_pages=pl.cdiv(kv_end, page_size), first_page=first_page,
    )
    pages_per_block = stream.pages_per_block
    q = q_ref[...]  # rows of padding tokens may hold anything; they only reach their own (zeroed) rows
    step = functools.partial(
        cm.causal_block_step, row_pos=row_pos, length=kv_end, kv_end=kv_end, sm_scale=sm_scale,
        sliding_window=sliding_window, logit_softcap=logit_softcap,
    )

    def body(block, k, v, scales, state):
        first_key = cm.plus(block * pages_per_block * page_size, first_page * page_size)
        return step(state, q, k, v, first_key=first_key, scales=scales)

    num_blocks = cm.blocks_from(first_page, kv_end, page_size, pages_per_block)
    state = fold_pages(stream, num_blocks, body, cm.init_softmax_state(rows, head_dim, sinks_ref))
    o_ref[...] = jnp.where(real, cm.finalize(state), 0.0).astype(o_ref.dtype)


def _tpu_call(q_items, k_pool, v_pool, k_scales, v_scales, layer, block_tables, items: _Items, geometry, *, block_q,
              sm_scale, pages_per_block, sliding_window, logit_softcap, sinks, interpret):
    """q_items [items, kvh, group * block_q, D] from ``_gather_items`` -> an array shaped like it."""
    num_items, num_kv_heads, rows, head_dim = q_items.shape
    g = geometry
    pages_per_seq = block_tables.shape[1]
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda h, w, *_: (w, h, 0, 0))
    kernel = functools.partial(
        _tpu_kernel, sm_scale=sm_scale, pages_per_seq=pages_per_seq, page_size=g.page_size, block_q=block_q,
        quantized=k_scales is not None, sliding_window=sliding_window, logit_softcap=logit_softcap,
        has_sinks=sinks is not None,
    )
    pool_specs, pool_arrays, scratch = stream_operands(
        k_pool, v_pool, k_scales, v_scales, layer, block_tables, g, pages_per_block
    )
    sink_specs, sink_arrays = cm.sink_operands(sinks, num_kv_heads, rows, block_q, lambda h, w, *_: (h, 0, 0))
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_kv_heads, num_items),
            in_specs=[q_spec, *sink_specs, *pool_specs],
            out_specs=q_spec,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct(q_items.shape, q_items.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=cm.interpret_arg("tpu", interpret),
        name="ragged_paged_attention_tpu",
    )(items.rows, items.first_pos, items.kv_end, block_tables.reshape(-1), layer, q_items, *sink_arrays,
      *pool_arrays)


# --------------------------------------------------------------------------------------------- GPU


def _gpu_kernel(
    q_ref,  # [group_p * block_q, head_dim]
    k_ref,  # [num_layers * num_kv_heads * total_pages, page_size, head_dim], the stacked pool's pages
    v_ref,  # [num_layers * num_kv_heads * total_pages, page_size, head_dim]
    # an int8 pool's scales f32[num_layers * num_kv_heads * total_pages, page_size] (k, v), then:
    # table_ref i32[padded_pages_per_seq], the item's row's block table; meta_ref i32[3]: the item's first
    # position, kv_end, the layer (i32[4]: and the window, a traced one); with sinks f32[group_p * block_q, 1];
    # o_ref [group_p * block_q, head_dim]
    *refs,
    quantized: bool,
    sm_scale: float,
    pages_per_block: int,
    block_q: int,
    num_kv_heads: int,
    total_pages: int,
    sliding_window: int | None,
    logit_softcap: float | None,
    has_sinks: bool,
):
    (ks_ref, vs_ref), (table_ref, meta_ref, *refs) = cm.split_scale_refs(refs, quantized)
    sinks_ref, (o_ref,) = cm.split_sinks_ref(refs, has_sinks)
    page_size, head_dim = k_ref.shape[1], k_ref.shape[2]
    block_tokens = pages_per_block * page_size
    kv_end = meta_ref[1]
    sliding_window = cm.kernel_window(sliding_window, meta_ref, index=3)
    rows = q_ref.shape[0]
    first_pos = meta_ref[0]
    row_pos = cm.row_positions(first_pos, rows, block_q)
    real = (row_pos >= 0) & (row_pos < kv_end)
    first_block = cm.block_of_page(cm.window_first_page(first_pos, sliding_window, page_size), 0, pages_per_block)
    q = q_ref[...]
    step = functools.partial(
        cm.causal_block_step, row_pos=row_pos, length=kv_end, kv_end=kv_end, sm_scale=sm_scale,
        sliding_window=sliding_window, logit_softcap=logit_softcap,
    )
    first_of_head = cm.first_page_of(meta_ref[2], pl.program_id(0), num_kv_heads, total_pages)

    def body(block, state):
        pages = table_ref[pl.ds(block * pages_per_block, pages_per_block)]
        pages = first_of_head + cm.live_pages_only(pages, block * pages_per_block, pl.cdiv(kv_end, page_size))
        k = cm.kv_values(k_ref[pages].reshape(block_tokens, head_dim), q.dtype)
        v = cm.kv_values(v_ref[pages].reshape(block_tokens, head_dim), q.dtype)
        scales = cm.gpu_block_scales(ks_ref, vs_ref, pages)
        return step(state, q, k, v, first_key=block * block_tokens, scales=scales)

    num_blocks = pl.cdiv(kv_end, block_tokens)
    state = jax.lax.fori_loop(first_block, num_blocks, body, cm.init_softmax_state(rows, head_dim, sinks_ref))
    o_ref[...] = jnp.where(real, cm.finalize(state), 0.0).astype(o_ref.dtype)


def _gpu_call(q_items, k_pool, v_pool, k_scales, v_scales, layer, block_tables, items: _Items, geometry, *, block_q,
              sm_scale, pages_per_block, num_warps, num_stages, sliding_window, logit_softcap, sinks, interpret):
    """q_items [items, kvh, group_p * block_q, D] from ``_gather_items`` -> an array shaped like it."""
    num_items, num_kv_heads, rows, head_dim = q_items.shape
    pages_per_seq = block_tables.shape[1]
    # Each item's row's table, padded to whole compute blocks (page 0: past kv_end, never read).
    table = jnp.pad(block_tables[items.rows], ((0, 0), (0, -pages_per_seq % pages_per_block)))
    meta = cm.per_row_meta([items.first_pos, items.kv_end], layer)  # i32[items, 3 (4: with a traced window)]
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda h, w: (w, h, 0, 0))
    pool_specs, pool_arrays = cm.gpu_pool_operands(k_pool, v_pool, k_scales, v_scales)
    kernel = functools.partial(
        _gpu_kernel, quantized=k_scales is not None, sm_scale=sm_scale, pages_per_block=pages_per_block,
        block_q=block_q, num_kv_heads=num_kv_heads, total_pages=geometry.total_pages, sliding_window=sliding_window,
        logit_softcap=logit_softcap, has_sinks=sinks is not None,
    )
    sink_specs, sink_arrays = cm.sink_operands(sinks, num_kv_heads, rows, block_q, lambda h, w: (h, 0, 0))
    return pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_items),
        in_specs=[
            q_spec,
            *pool_specs,
            pl.BlockSpec((None, table.shape[1]), lambda h, w: (w, 0)),
            pl.BlockSpec((None, meta.shape[1]), lambda h, w: (w, 0)),
            *sink_specs,
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q_items.shape, q_items.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=cm.interpret_arg("gpu", interpret),
        name="ragged_paged_attention_gpu",
    )(q_items, *pool_arrays, table, meta, *sink_arrays)


# ------------------------------------------------------------------------------------------ public


def _validate(q, k_pages, v_pages, block_tables, query_starts, query_lens, positions, lengths, k_scales,
              v_scales) -> cm.PoolGeometry:
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    geometry = cm.check_query_and_pool(q, k_pages, v_pages, "[num_tokens, num_q_heads, head_dim]", k_scales, v_scales)
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must have shape (num_rows, pages_per_seq), got {block_tables.shape}")
    if block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    num_rows = block_tables.shape[0]
    for name, x in (("query_starts", query_starts), ("query_lens", query_lens), ("positions", positions),
                    ("lengths", lengths)):
        if x.shape != (num_rows,):
            raise ValueError(f"{name} must have shape (num_rows,) = ({num_rows},) like block_tables' first "
                             f"dim, got {x.shape}")
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")
    return geometry


@cm.jit_with_window(
    static_argnames=(
        "sm_scale",
        "backend",
        "interpret",
        "block_q",
        "pages_per_compute_block",
        "num_warps",
        "num_stages",
        "sliding_window",
        "logit_softcap",
    ),
)
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]: every row's query tokens, back to back
    k_pages: jax.Array,  # one layer [Hkv, num_blocks, block_size, D] or stacked [L, Hkv, num_blocks, rows, lanes]
    v_pages: jax.Array,  # like k_pages
    block_tables: jax.Array,  # i32[S, P]
    query_starts: jax.Array,  # i32[S]: row s's first token in q
    query_lens: jax.Array,  # i32[S]: row s's tokens in q (0: an empty row)
    positions: jax.Array,  # i32[S]: position of row s's first token in its sequence
    lengths: jax.Array,  # i32[S]: tokens of row s's sequence it may see (its own tokens included)
    *,
    layer: jax.Array | int | None = None,  # i32[]: the layer to read of a stacked pool
    sm_scale: float,
    interpret: bool = False,
    block_q: int | None = None,
    pages_per_compute_block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    backend: str = "auto",
    sliding_window: int | jax.Array | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,  # f32[Hq]: attention sinks (gpt-oss)
    k_scales: jax.Array | None = None,  # f32[L, Hkv, num_blocks, block_size] ([Hkv, ...] for one layer): int8 pool
    v_scales: jax.Array | None = None,  # like k_scales
) -> jax.Array:  # [T, Hq, D], q.dtype; zeros for tokens in no row and tokens outside [0, length)
    """Causal attention of ragged rows (decode tokens and prefill chunks) over the paged KV cache.

    Args:
      q, k_pages, v_pages, block_tables, query_starts, query_lens, positions, lengths: see the shape
        comments and the module docstring. The step's K/V must already be in the pages. The pool is one
        layer's pages or the stacked pool read in place at ``layer`` (as in ``paged_attention``).
      layer: the layer of a stacked pool (None for a one-layer pool).
      sm_scale: softmax scale (e.g. 1/sqrt(D)).
      interpret: run in the Pallas interpreter (CPU testing); TPU also accepts ``pltpu.InterpretParams``.
      block_q: query tokens per work item (power of two). Default from ``TUNED_BLOCK_SIZES``.
      pages_per_compute_block: pages per KV block (power of two); capped at the block table width.
      num_warps, num_stages: GPU only, Triton launch parameters.
      backend: "tpu", "gpu" or "auto" (as in ``paged_attention``).
      sliding_window: a token at position p attends only keys p - sliding_window < k <= p; None or 0: all.
        Static (a Python int) or traced (an i32 scalar array, 0: none), as in ``paged_attention``.
      logit_softcap: soft-cap c of the scaled scores, c * tanh(s / c) (Gemma 2: 50.0); None or 0: no cap.
      sinks: a logit per query head in its softmax's denominator (as in ``paged_attention``); None: none.
      k_scales, v_scales: an int8 pool's scales per token and kv head (as in ``paged_attention``).
    """
    geometry = _validate(q, k_pages, v_pages, block_tables, query_starts, query_lens, positions, lengths, k_scales,
                         v_scales)
    sliding_window, logit_softcap = cm.check_window_and_softcap(sliding_window, logit_softcap)
    sinks = cm.check_sinks(sinks, q.shape[1])
    k_pool, v_pool, k_scales, v_scales, layer_index = cm.stacked_kv(k_pages, v_pages, k_scales, v_scales, layer)
    sliding_window, layer_index = cm.window_in_layer(sliding_window, layer_index)
    backend = cm.resolve_backend(backend, interpret)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, total_pages, page_size = geometry.num_kv_heads, geometry.total_pages, geometry.page_size
    num_rows, pages_per_seq = block_tables.shape
    knobs = cm.tuned_knobs(
        TUNED_BLOCK_SIZES,
        (backend, page_size, head_dim),
        DEFAULT_BLOCK_SIZES[backend],
        block_q=block_q,
        pages_per_compute_block=pages_per_compute_block,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    cm.check_positive_power_of_2("block_q", knobs["block_q"])
    cm.check_positive_power_of_2("pages_per_compute_block", knobs["pages_per_compute_block"])
    if backend == "tpu":
        cm.reject_knobs("tpu", num_warps=num_warps, num_stages=num_stages)
    if num_tokens == 0 or num_rows == 0 or pages_per_seq == 0 or total_pages == 0:
        return jnp.zeros_like(q)
    block_q = knobs["block_q"]
    num_items = max(1, (num_tokens + num_rows * (block_q - 1)) // block_q)
    lengths = jnp.clip(lengths, 0, pages_per_seq * page_size)  # never walk past the block table
    block_tables = jnp.clip(block_tables, 0, total_pages - 1)  # like an XLA gather (and the CPU kernel)
    items = _Items(query_starts, query_lens, positions, lengths, num_tokens=num_tokens, block_q=block_q,
                   num_items=num_items)
    common = dict(
        block_q=block_q,
        sm_scale=float(sm_scale),
        pages_per_block=cm.fit_pages_per_block(knobs["pages_per_compute_block"], pages_per_seq),
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        sinks=sinks,
        interpret=interpret,
    )
    group = num_q_heads // num_kv_heads
    if backend == "tpu":
        group_p, call = group, _tpu_call
    else:
        cm.check_gpu_layout(geometry)
        # Triton tensors need power-of-two sizes and dots >= 16 rows: pad the group with zero heads
        group_p = max(cm.next_power_of_2(group), pl.cdiv(MIN_GPU_ROWS, block_q))
        call = functools.partial(_gpu_call, num_warps=knobs["num_warps"], num_stages=knobs["num_stages"])
    q_items = _gather_items(q, items, num_kv_heads, group_p, block_q)
    out = call(q_items, k_pool, v_pool, k_scales, v_scales, layer_index, block_tables, items, geometry, **common)
    return _scatter_items(out, items, q.shape, group_p, block_q)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "logit_softcap"))
def ragged_paged_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # as in ragged_paged_attention
    v_pages: jax.Array,
    block_tables: jax.Array,  # i32[S, P]
    query_starts: jax.Array,  # i32[S]
    query_lens: jax.Array,  # i32[S]
    positions: jax.Array,  # i32[S]
    lengths: jax.Array,  # i32[S]
    *,
    layer: jax.Array | int | None = None,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:  # [T, Hq, D], q.dtype
    """Plain-jnp ragged attention (float32 math): every token gathers its row's pages through the block
    table (an [T, Hkv, P * block_size, D] copy, so for tests and small batches) and takes a masked softmax.
    Same semantics as ``ragged_paged_attention``, ``sliding_window``, ``logit_softcap`` and an int8 pool's
    scales included."""
    geometry = _validate(q, k_pages, v_pages, block_tables, query_starts, query_lens, positions, lengths, k_scales,
                         v_scales)
    sliding_window, logit_softcap = cm.check_window_and_softcap(sliding_window, logit_softcap)
    k_pages, v_pages = cm.reference_pages(k_pages, v_pages, layer, geometry, k_scales, v_scales)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, total_pages, page_size, _ = k_pages.shape
    num_rows, pages_per_seq = block_tables.shape
    if num_tokens == 0 or num_rows == 0 or pages_per_seq == 0:
        return jnp.zeros_like(q)
    lengths = jnp.clip(lengths, 0, pages_per_seq * page_size)
    block_tables = jnp.clip(block_tables, 0, total_pages - 1)
    # Each token's row: the last row whose query range holds it (-1: none).
    token = jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
    in_row = (token >= query_starts[None, :]) & (token < query_starts[None, :] + query_lens[None, :])  # [T, S]
    row = jnp.where(in_row.any(axis=1), num_rows - 1 - jnp.argmax(in_row[:, ::-1], axis=1), -1)
    safe_row = jnp.maximum(row, 0)
    position = positions[safe_row] + token[:, 0] - query_starts[safe_row]  # [T]
    length = jnp.where(row >= 0, lengths[safe_row], 0)
    real = (row >= 0) & (position >= 0) & (position < length)  # [T]
    k = gather_pages(k_pages, block_tables[safe_row])  # f32[T, kvh, P * page_size, D]
    v = gather_pages(v_pages, block_tables[safe_row])
    key = jnp.arange(k.shape[2])[None, :]
    seen = cm.attend_mask(key, position[:, None], length[:, None], sliding_window) & real[:, None]  # [T, keys]
    k = jnp.where(seen[:, None, :, None], k, 0.0)
    v = jnp.where(seen[:, None, :, None], v, 0.0)
    qg = jnp.where(real[:, None, None], q.astype(jnp.float32), 0.0)
    qg = qg.reshape(num_tokens, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    s = cm.softcap(jnp.einsum("thgd,thkd->thgk", qg, k) * sm_scale, logit_softcap)
    s = jnp.where(seen[:, None, None, :], s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True, initial=cm.MASK_VALUE))
    out = jnp.einsum("thgk,thkd->thgd", p, v) / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    out = jnp.where(real[:, None, None, None], out, 0.0)
    return out.reshape(q.shape).astype(q.dtype)
