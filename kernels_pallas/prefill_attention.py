"""Causal attention of a chunk of prompt tokens over the paged KV cache (chunked prefill).

Place in the data flow: for a prefill step the engine's attention backend first writes the chunk's K/V into
the sequence's pages, then calls ``prefill_attention`` once per layer with the stacked KV pool and the layer
index (read in place). Each query row attends to the cached prefix and to the chunk up
to and including itself. The result feeds the layer's output projection.

Query row i of sequence s sits at position q_start[s] + i and attends keys j <= q_start[s] + i with
j < lengths[s]. Rows with q_start[s] + i >= lengths[s] are padding and come out as zeros. Block-table
entries past a sequence's length are never dereferenced (they may hold anything).

Optional variants: ``sliding_window`` W (static, or traced: the layer's own, carried in the layer
operand) further limits a query at position p to keys
p - W < j; a program starts its page walk at the page holding the window start of its block's first query
(the GPU variant: at the compute block holding that page), and masking gives every row its own window.
``logit_softcap`` c replaces the scaled scores s by c * tanh(s / c) before masking and the softmax.

Over the int8 KV cache (``k_scales`` / ``v_scales``: a float32 scale per token and kv head, written by the
engine with the int8 values) the pages are widened to q's dtype and the scales applied to the scores and
the softmax weights, as in ``paged_attention`` (``_common``, ``_tpu_paging``).

Two Pallas variants, both on grid (sequence, kv head, query block) with an online softmax over KV blocks
that stops at the block's causal/length limit (and, with a window, starts at its window start):
* TPU (Mosaic): q_start, lengths and block tables scalar-prefetched into SMEM; pages DMA'd from HBM into
  double-buffered VMEM blocks.
* GPU (Triton): flash-attention style; each program gathers pages through the block table.

Inside a program, the rows are the KV group's query heads times ``block_q`` tokens, head-major
(row = head * block_q + token), so one K/V load serves all heads of the group.
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

# Knobs per (backend, page_size, head_dim); starting points, not yet measured on hardware.
TUNED_BLOCK_SIZES: dict[tuple[str, int, int], dict[str, int]] = {
    ("tpu", 16, 64): {"block_q": 128, "pages_per_compute_block": 8},
    ("tpu", 16, 128): {"block_q": 128, "pages_per_compute_block": 8},
    ("tpu", 32, 64): {"block_q": 128, "pages_per_compute_block": 4},
    ("tpu", 32, 128): {"block_q": 128, "pages_per_compute_block": 4},
    ("tpu", 64, 64): {"block_q": 128, "pages_per_compute_block": 2},
    ("tpu", 64, 128): {"block_q": 128, "pages_per_compute_block": 2},
    ("tpu", 128, 64): {"block_q": 128, "pages_per_compute_block": 1},
    ("tpu", 128, 128): {"block_q": 128, "pages_per_compute_block": 1},
    ("gpu", 16, 64): {"block_q": 32, "pages_per_compute_block": 4, "num_warps": 4, "num_stages": 2},
    ("gpu", 16, 128): {"block_q": 32, "pages_per_compute_block": 4, "num_warps": 4, "num_stages": 2},
    ("gpu", 32, 64): {"block_q": 32, "pages_per_compute_block": 2, "num_warps": 4, "num_stages": 2},
    ("gpu", 32, 128): {"block_q": 32, "pages_per_compute_block": 2, "num_warps": 4, "num_stages": 2},
    ("gpu", 64, 64): {"block_q": 32, "pages_per_compute_block": 1, "num_warps": 4, "num_stages": 2},
    ("gpu", 64, 128): {"block_q": 32, "pages_per_compute_block": 1, "num_warps": 4, "num_stages": 2},
    ("gpu", 128, 64): {"block_q": 32, "pages_per_compute_block": 1, "num_warps": 8, "num_stages": 2},
    ("gpu", 128, 128): {"block_q": 16, "pages_per_compute_block": 1, "num_warps": 8, "num_stages": 2},
}
DEFAULT_BLOCK_SIZES = {
    "tpu": {"block_q": 128, "pages_per_compute_block": 2},
    "gpu": {"block_q": 32, "pages_per_compute_block": 1, "num_warps": 4, "num_stages": 2},
}
MIN_BLOCK_Q = 16  # Triton dots need >= 16 rows; on TPU it keeps row blocks sublane-aligned.


def _kv_end(first_q: jax.Array, length: jax.Array, block_q: int) -> jax.Array:
    """Exclusive key limit of a query block: 0 when the block is all padding."""
    return jnp.where(first_q < length, jnp.minimum(length, first_q + block_q), 0)


# --------------------------------------------------------------------------------------------- TPU


def _tpu_kernel(
    q_start_ref,  # SMEM i32[num_seqs]
    lengths_ref,  # SMEM i32[num_seqs]
    table_ref,  # SMEM i32[num_seqs * pages_per_seq]
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
    seq, head, q_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = lengths_ref[seq]
    sliding_window = cm.kernel_window(sliding_window, layer_ref)
    first_q = q_start_ref[seq] + q_block * block_q
    kv_end = _kv_end(first_q, length, block_q)
    rows, head_dim = q_ref.shape
    row_pos = cm.row_positions(first_q, rows, block_q)
    first_page = cm.window_first_page(first_q, sliding_window, page_size)
    stream, o_ref = open_stream(
        refs, quantized=quantized, table_ref=table_ref, table_row=seq, pages_per_seq=pages_per_seq,
        layer=layer_ref[0], head=head, num_pages=pl.cdiv(kv_end, page_size), first_page=first_page,
    )
    pages_per_block = stream.pages_per_block
    q = q_ref[...]
    step = functools.partial(
        cm.causal_block_step, row_pos=row_pos, length=length, kv_end=kv_end, sm_scale=sm_scale,
        sliding_window=sliding_window, logit_softcap=logit_softcap,
    )

    def body(block, k, v, scales, state):
        first_key = cm.plus(block * pages_per_block * page_size, first_page * page_size)
        return step(state, q, k, v, first_key=first_key, scales=scales)

    num_blocks = cm.blocks_from(first_page, kv_end, page_size, pages_per_block)
    state = fold_pages(stream, num_blocks, body, cm.init_softmax_state(rows, head_dim, sinks_ref))
    out = jnp.where(row_pos < length, cm.finalize(state), 0.0)
    o_ref[...] = out.astype(o_ref.dtype)


def _tpu_call(
    q5, k_pool, v_pool, k_scales, v_scales, layer, page_indices, q_start, lengths, geometry, *, block_q, sm_scale,
    pages_per_block, sliding_window, logit_softcap, sinks, interpret
):
    """q5 [num_seqs, num_kv_heads, q_blocks, group_p * block_q, head_dim] from ``_to_row_blocks``; others
    as in ``prefill_attention`` (validated, pools stacked, lengths clamped). Returns an array shaped like q5."""
    num_seqs, num_kv_heads, num_q_blocks, rows, head_dim = q5.shape
    g = geometry
    pages_per_seq = page_indices.shape[1]
    q_spec = pl.BlockSpec((None, None, None, rows, head_dim), lambda s, h, b, *_: (s, h, b, 0, 0))
    kernel = functools.partial(
        _tpu_kernel, sm_scale=sm_scale, pages_per_seq=pages_per_seq, page_size=g.page_size, block_q=block_q,
        quantized=k_scales is not None, sliding_window=sliding_window, logit_softcap=logit_softcap,
        has_sinks=sinks is not None,
    )
    pool_specs, pool_arrays, scratch = stream_operands(
        k_pool, v_pool, k_scales, v_scales, layer, page_indices, g, pages_per_block
    )
    sink_specs, sink_arrays = cm.sink_operands(sinks, num_kv_heads, rows, block_q, lambda s, h, b, *_: (h, 0, 0))
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_seqs, num_kv_heads, num_q_blocks),
            in_specs=[q_spec, *sink_specs, *pool_specs],
            out_specs=q_spec,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct(q5.shape, q5.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=cm.interpret_arg("tpu", interpret),
        name="prefill_attention_tpu",
    )(q_start, lengths, page_indices.reshape(-1), layer, q5, *sink_arrays, *pool_arrays)


# --------------------------------------------------------------------------------------------- GPU


def _gpu_kernel(
    q_ref,  # [group_p * block_q, head_dim], group padded to a power of two
    k_ref,  # [num_layers * num_kv_heads * total_pages, page_size, head_dim], the stacked pool's pages
    v_ref,  # [num_layers * num_kv_heads * total_pages, page_size, head_dim]
    # an int8 pool's scales f32[num_layers * num_kv_heads * total_pages, page_size] (k, v), then:
    # table_ref i32[padded_pages_per_seq], this sequence's block table; meta_ref i32[3]: q_start, length,
    # layer (i32[4]: and the window, a traced one); with sinks f32[group_p * block_q, 1]; o_ref [group_p *
    # block_q, head_dim]
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
    length = meta_ref[1]
    sliding_window = cm.kernel_window(sliding_window, meta_ref, index=3)
    first_q = meta_ref[0] + pl.program_id(2) * block_q
    kv_end = _kv_end(first_q, length, block_q)
    rows = q_ref.shape[0]
    row_pos = cm.row_positions(first_q, rows, block_q)
    first_block = cm.block_of_page(cm.window_first_page(first_q, sliding_window, page_size), 0, pages_per_block)
    q = q_ref[...]
    step = functools.partial(
        cm.causal_block_step, row_pos=row_pos, length=length, kv_end=kv_end, sm_scale=sm_scale,
        sliding_window=sliding_window, logit_softcap=logit_softcap,
    )
    first_of_head = cm.first_page_of(meta_ref[2], pl.program_id(1), num_kv_heads, total_pages)

    def body(block, state):
        pages = table_ref[pl.ds(block * pages_per_block, pages_per_block)]
        pages = first_of_head + cm.live_pages_only(pages, block * pages_per_block, pl.cdiv(kv_end, page_size))
        k = cm.kv_values(k_ref[pages].reshape(block_tokens, head_dim), q.dtype)
        v = cm.kv_values(v_ref[pages].reshape(block_tokens, head_dim), q.dtype)
        scales = cm.gpu_block_scales(ks_ref, vs_ref, pages)
        return step(state, q, k, v, first_key=block * block_tokens, scales=scales)

    num_blocks = pl.cdiv(kv_end, block_tokens)
    state = jax.lax.fori_loop(first_block, num_blocks, body, cm.init_softmax_state(rows, head_dim, sinks_ref))
    out = jnp.where(row_pos < length, cm.finalize(state), 0.0)
    o_ref[...] = out.astype(o_ref.dtype)


def _gpu_call(
    q5,
    k_pool,
    v_pool,
    k_scales,
    v_scales,
    layer,
    page_indices,
    q_start,
    lengths,
    geometry,
    *,
    block_q,
    sm_scale,
    pages_per_block,
    num_warps,
    num_stages,
    sliding_window,
    logit_softcap,
    sinks,
    interpret,
):
    """q5 [num_seqs, num_kv_heads, q_blocks, group_p * block_q, head_dim] from ``_to_row_blocks``; others
    as in ``prefill_attention`` (validated, lengths clamped). Returns an array shaped like q5."""
    num_seqs, num_kv_heads, num_q_blocks, rows, head_dim = q5.shape
    pages_per_seq = page_indices.shape[1]
    # Pad the table to whole compute blocks; the padding (page 0) lies past every length and is masked.
    table = jnp.pad(page_indices, ((0, 0), (0, -pages_per_seq % pages_per_block)))
    meta = cm.per_row_meta([q_start, lengths], layer)  # i32[num_seqs, 3 (4: with a traced window)]
    q_spec = pl.BlockSpec((None, None, None, rows, head_dim), lambda s, h, b: (s, h, b, 0, 0))
    pool_specs, pool_arrays = cm.gpu_pool_operands(k_pool, v_pool, k_scales, v_scales)
    kernel = functools.partial(
        _gpu_kernel, quantized=k_scales is not None, sm_scale=sm_scale, pages_per_block=pages_per_block,
        block_q=block_q, num_kv_heads=num_kv_heads, total_pages=geometry.total_pages, sliding_window=sliding_window,
        logit_softcap=logit_softcap, has_sinks=sinks is not None,
    )
    sink_specs, sink_arrays = cm.sink_operands(sinks, num_kv_heads, rows, block_q, lambda s, h, b: (h, 0, 0))
    return pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, num_q_blocks),
        in_specs=[
            q_spec,
            *pool_specs,
            pl.BlockSpec((None, table.shape[1]), lambda s, h, b: (s, 0)),
            pl.BlockSpec((None, meta.shape[1]), lambda s, h, b: (s, 0)),
            *sink_specs,
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q5.shape, q5.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=cm.interpret_arg("gpu", interpret),
        name="prefill_attention_gpu",
    )(q5, *pool_arrays, table, meta, *sink_arrays)


# ------------------------------------------------------------------------------------------ public


def _to_row_blocks(q, num_kv_heads: int, group_p: int, block_q: int) -> jax.Array:
    """q [s, chunk, qh, d] -> [s, kvh, q_blocks, group_p * block_q, d], rows head-major within a block."""
    num_seqs, chunk_len, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    num_q_blocks = pl.cdiv(chunk_len, block_q)
    x = q.reshape(num_seqs, chunk_len, num_kv_heads, group, head_dim)
    x = jnp.pad(x, ((0, 0), (0, num_q_blocks * block_q - chunk_len), (0, 0), (0, group_p - group), (0, 0)))
    x = x.reshape(num_seqs, num_q_blocks, block_q, num_kv_heads, group_p, head_dim)
    x = x.transpose(0, 3, 1, 4, 2, 5)  # [s, kvh, q_blocks, group_p, block_q, d]
    return x.reshape(num_seqs, num_kv_heads, num_q_blocks, group_p * block_q, head_dim)


def _from_row_blocks(x, q_shape, group_p: int, block_q: int) -> jax.Array:
    """Inverse of ``_to_row_blocks``: back to [s, chunk, qh, d]."""
    num_seqs, chunk_len, num_q_heads, head_dim = q_shape
    _, num_kv_heads, num_q_blocks, _, _ = x.shape
    group = num_q_heads // num_kv_heads
    x = x.reshape(num_seqs, num_kv_heads, num_q_blocks, group_p, block_q, head_dim)
    x = x.transpose(0, 2, 4, 1, 3, 5)[:, :, :, :, :group]  # [s, q_blocks, block_q, kvh, group, d]
    return x.reshape(num_seqs, num_q_blocks * block_q, num_q_heads, head_dim)[:, :chunk_len]


def _validate(q, k_pages, v_pages, page_indices, q_start, lengths, k_scales, v_scales) -> cm.PoolGeometry:
    if q.ndim != 4:
        raise ValueError(f"q must be [num_seqs, chunk_len, num_q_heads, head_dim], got shape {q.shape}")
    geometry = cm.check_query_and_pool(
        q, k_pages, v_pages, "[num_seqs, chunk_len, num_q_heads, head_dim]", k_scales, v_scales
    )
    cm.check_page_indices(page_indices, q.shape[0])
    cm.check_int_vector("q_start", q_start, q.shape[0])
    cm.check_int_vector("lengths", lengths, q.shape[0])
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
def prefill_attention(
    q: jax.Array,  # [num_seqs, chunk_len, num_q_heads, head_dim]
    k_pages: jax.Array,  # one layer [Hkv, total_pages, page_size, D] or stacked [L, Hkv, total_pages, rows, lanes]
    v_pages: jax.Array,  # like k_pages
    page_indices: jax.Array,  # i32[num_seqs, pages_per_seq], block table
    q_start: jax.Array,  # i32[num_seqs], position of each chunk's first token
    lengths: jax.Array,  # i32[num_seqs], context length after the chunk (q_start + real chunk tokens)
    *,
    layer: jax.Array | int | None = None,  # i32[]: the layer to read of a stacked pool
    sm_scale: float | None = None,
    backend: str = "auto",
    interpret: bool = False,
    block_q: int | None = None,
    pages_per_compute_block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    sliding_window: int | jax.Array | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,  # f32[num_q_heads]: attention sinks (gpt-oss)
    k_scales: jax.Array | None = None,  # f32[L, Hkv, total_pages, page_size] ([Hkv, ...] for one layer): int8 pool
    v_scales: jax.Array | None = None,  # like k_scales
) -> jax.Array:  # [num_seqs, chunk_len, num_q_heads, head_dim], q.dtype; padding rows are zeros
    """Causal attention of a chunk of query tokens over the paged KV cache (prefix + the chunk itself).

    Args:
      q, k_pages, v_pages, page_indices, q_start, lengths: see the shape comments. The chunk's K/V must
        already be in the pages. ``lengths`` above pages_per_seq * page_size are clamped to it. The pool
        is one layer's pages or the stacked pool read in place at ``layer`` (as in ``paged_attention``).
      layer: the layer of a stacked pool (None for a one-layer pool).
      sm_scale: softmax scale, default 1/sqrt(head_dim).
      backend: "tpu", "gpu" or "auto" (as in ``paged_attention``).
      interpret: run in the Pallas interpreter (CPU testing); TPU also accepts ``pltpu.InterpretParams``.
      block_q: query tokens per program (power of two >= 16; capped at the chunk length rounded up).
      pages_per_compute_block: pages per KV block (power of two); capped at the block table width.
      num_warps, num_stages: GPU only, Triton launch parameters.
      sliding_window: a query at position p attends only keys p - sliding_window < j <= p; None or 0: all.
        Static (a Python int) or traced (an i32 scalar array, 0: none), as in ``paged_attention``.
      logit_softcap: soft-cap c of the scaled scores, c * tanh(s / c) (Gemma 2: 50.0); None or 0: no cap.
      sinks: a logit per query head in its softmax's denominator (as in ``paged_attention``); None: none.
      k_scales, v_scales: an int8 pool's scales per token and kv head (as in ``paged_attention``).
    """
    geometry = _validate(q, k_pages, v_pages, page_indices, q_start, lengths, k_scales, v_scales)
    sliding_window, logit_softcap = cm.check_window_and_softcap(sliding_window, logit_softcap)
    sinks = cm.check_sinks(sinks, q.shape[2])
    k_pool, v_pool, k_scales, v_scales, layer_index = cm.stacked_kv(k_pages, v_pages, k_scales, v_scales, layer)
    sliding_window, layer_index = cm.window_in_layer(sliding_window, layer_index)
    backend = cm.resolve_backend(backend, interpret)
    num_seqs, chunk_len, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = geometry.num_kv_heads, geometry.page_size
    knobs = cm.tuned_knobs(
        TUNED_BLOCK_SIZES,
        (backend, page_size, head_dim),
        DEFAULT_BLOCK_SIZES[backend],
        block_q=block_q,
        pages_per_compute_block=pages_per_compute_block,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    cm.check_positive_power_of_2("block_q", knobs["block_q"], MIN_BLOCK_Q)
    cm.check_positive_power_of_2("pages_per_compute_block", knobs["pages_per_compute_block"])
    block_q = min(knobs["block_q"], max(MIN_BLOCK_Q, cm.next_power_of_2(chunk_len)))
    pages_per_seq = page_indices.shape[1]
    common = dict(
        block_q=block_q,
        sm_scale=cm.default_scale(sm_scale, head_dim),
        pages_per_block=cm.fit_pages_per_block(knobs["pages_per_compute_block"], pages_per_seq),
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        sinks=sinks,
        interpret=interpret,
    )
    lengths = jnp.clip(lengths, 0, pages_per_seq * page_size)  # never walk past the block table
    group = num_q_heads // num_kv_heads
    if backend == "tpu":
        cm.reject_knobs("tpu", num_warps=num_warps, num_stages=num_stages)
        group_p, call = group, _tpu_call
    else:
        cm.check_gpu_layout(geometry)
        group_p = cm.next_power_of_2(group)  # Triton tensors need power-of-two sizes
        call = functools.partial(_gpu_call, num_warps=knobs["num_warps"], num_stages=knobs["num_stages"])
    q5 = _to_row_blocks(q, num_kv_heads, group_p, block_q)
    out = call(q5, k_pool, v_pool, k_scales, v_scales, layer_index, page_indices, q_start, lengths, geometry,
               **common)
    return _from_row_blocks(out, q.shape, group_p, block_q)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "logit_softcap"))
def prefill_attention_reference(
    q: jax.Array,  # [num_seqs, chunk_len, num_q_heads, head_dim]
    k_pages: jax.Array,  # as in prefill_attention
    v_pages: jax.Array,
    page_indices: jax.Array,  # i32[num_seqs, pages_per_seq]
    q_start: jax.Array,  # i32[num_seqs]
    lengths: jax.Array,  # i32[num_seqs]
    *,
    layer: jax.Array | int | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:  # [num_seqs, chunk_len, num_q_heads, head_dim], q.dtype; padding rows are zeros
    """Plain-jnp chunked causal attention through the block table (float32 math); ``sliding_window``,
    ``logit_softcap`` and an int8 pool's scales as in ``prefill_attention``."""
    geometry = _validate(q, k_pages, v_pages, page_indices, q_start, lengths, k_scales, v_scales)
    sliding_window, logit_softcap = cm.check_window_and_softcap(sliding_window, logit_softcap)
    k_pages, v_pages = cm.reference_pages(k_pages, v_pages, layer, geometry, k_scales, v_scales)
    return causal_paged_attention(
        q, k_pages, v_pages, page_indices, q_start, lengths, sm_scale=sm_scale, sliding_window=sliding_window,
        logit_softcap=logit_softcap,
    )


def causal_paged_attention(
    q: jax.Array,  # [num_seqs, chunk_len, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, total_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, total_pages, page_size, head_dim]
    page_indices: jax.Array,  # i32[num_seqs, pages_per_seq]
    q_start: jax.Array,  # i32[num_seqs]
    lengths: jax.Array,  # i32[num_seqs]
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> jax.Array:  # [num_seqs, chunk_len, num_q_heads, head_dim], q.dtype; padding rows are zeros
    """The reference math without the kernels' shape limits: any page size and head_dim, an optional
    sliding window (a query at position p sees keys p - window < j <= p) and logit soft-cap. Float32
    math."""
    k, v = gather_pages(k_pages, page_indices), gather_pages(v_pages, page_indices)  # [s, kvh, T, d]
    num_seqs, chunk_len, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    sm_scale = cm.default_scale(sm_scale, head_dim)
    key = jnp.arange(k.shape[2])[None, None, :]  # [1, 1, T]
    row = (q_start[:, None] + jnp.arange(chunk_len)[None, :])[:, :, None]  # [s, C, 1]
    mask = cm.attend_mask(key, row, lengths[:, None, None], sliding_window)  # [s, C, T]
    token_ok = key[:, 0, :, None] < lengths[:, None, None]  # [s, T, 1]
    k = jnp.where(token_ok[:, None], k, 0.0)
    v = jnp.where(token_ok[:, None], v, 0.0)
    qg = q.astype(jnp.float32).reshape(
        num_seqs, chunk_len, num_kv_heads, num_q_heads // num_kv_heads, head_dim
    )
    s = cm.softcap(jnp.einsum("schgd,shtd->shgct", qg, k) * sm_scale, logit_softcap)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True, initial=cm.MASK_VALUE))
    out = jnp.einsum("shgct,shtd->schgd", p, v)
    out = out / jnp.maximum(jnp.sum(p, axis=-1), 1e-30).transpose(0, 3, 1, 2)[..., None]
    out = jnp.where((row < lengths[:, None, None])[..., None, None], out, 0.0)
    return out.reshape(q.shape).astype(q.dtype)
