"""Decode attention over the paged KV cache: one new query token per sequence.

Place in the data flow: on every decode step the engine's attention backend calls ``paged_attention`` once
per layer, after writing the step's K/V into the pool, with the whole stacked KV pool and the layer index
(read in place: no layer's slice is copied), the batch's block tables and context lengths. The result
feeds the layer's output projection.

Two Pallas variants:
* TPU (Mosaic): grid (sequence, kv head). Lengths, block tables and the layer are scalar-prefetched; pages
  stay in HBM and are DMA'd into VMEM in double-buffered blocks of ``pages_per_compute_block`` pages; all
  query heads of a KV group are computed together with an online softmax.
* GPU (Triton): flash-decoding. Grid (sequence, kv head, split): each split walks its share of the block
  table (pages addressed by offset into the flattened stacked pool) and writes a partial (max, sum,
  output); a small XLA reduction combines the splits.

Tokens at positions >= length never influence the result, and block-table entries past a sequence's
length are never dereferenced (they may hold anything).
A sequence with length 0 produces zeros.

Over the int8 KV cache (``k_scales`` / ``v_scales``: a float32 scale per token and kv head, written by the
engine with the int8 values; ``_common``) the K scales multiply the scores and the V scales the softmax
weights. The TPU variant gets the scales of its block tables' pages gathered by XLA in the wrapper and DMAs
each compute block's window of them with the block's pages (``_tpu_paging``); the GPU variant reads them by
page offset like the pages.

Optional variants: ``sliding_window`` W (static, or traced: the layer's own, carried in the layer operand)
limits the query (at position length - 1) to the last W keys, positions length - W .. length - 1; the TPU
variant starts its page walk at the page holding
position length - W, the GPU variant each split's walk at the compute block holding that page (so at most
pages_per_compute_block - 1 pages before it are read; masking makes both exact). ``logit_softcap`` c
replaces the scaled scores s by c * tanh(s / c) before masking and the softmax (Gemma 2).
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

# Knobs per (backend, page_size, head_dim). Starting points sized so a compute block covers 128-512 tokens;
# the GPU's (16, 64) measured on an H200 (docs/benchmarks/gpu.md, `scripts/profile_gpu_steps.py --sweep`): one
# stage 7-14% faster than two at 16 and 256 rows, the block size within noise.
TUNED_BLOCK_SIZES: dict[tuple[str, int, int], dict[str, int]] = {
    ("tpu", 16, 64): {"pages_per_compute_block": 16},
    ("tpu", 16, 128): {"pages_per_compute_block": 16},
    ("tpu", 32, 64): {"pages_per_compute_block": 8},
    ("tpu", 32, 128): {"pages_per_compute_block": 8},
    ("tpu", 64, 64): {"pages_per_compute_block": 4},
    ("tpu", 64, 128): {"pages_per_compute_block": 4},
    ("tpu", 128, 64): {"pages_per_compute_block": 2},
    ("tpu", 128, 128): {"pages_per_compute_block": 2},
    ("gpu", 16, 64): {"pages_per_compute_block": 8, "num_warps": 4, "num_stages": 1},
    ("gpu", 16, 128): {"pages_per_compute_block": 8, "num_warps": 4, "num_stages": 2},
    ("gpu", 32, 64): {"pages_per_compute_block": 4, "num_warps": 4, "num_stages": 2},
    ("gpu", 32, 128): {"pages_per_compute_block": 4, "num_warps": 4, "num_stages": 2},
    ("gpu", 64, 64): {"pages_per_compute_block": 2, "num_warps": 4, "num_stages": 2},
    ("gpu", 64, 128): {"pages_per_compute_block": 2, "num_warps": 4, "num_stages": 2},
    ("gpu", 128, 64): {"pages_per_compute_block": 1, "num_warps": 4, "num_stages": 2},
    ("gpu", 128, 128): {"pages_per_compute_block": 1, "num_warps": 4, "num_stages": 2},
}
DEFAULT_BLOCK_SIZES = {
    "tpu": {"pages_per_compute_block": 4},
    "gpu": {"pages_per_compute_block": 2, "num_warps": 4, "num_stages": 2},
}
# Flash-decoding aims for about this many (sequence, kv head, split) programs: 8 per multiprocessor of an H100/H200
# (on an H200, 16 rows of 8 kv heads: 8 splits took 19.1 us, 3 splits (264 programs) 25.6; docs/benchmarks/gpu.md).
GPU_TARGET_PROGRAMS = 1056


def _window_first_page(length, sliding_window: int | None, page_size: int):
    """The page holding the decode query's first window key, length - W (the query sits at length - 1); the
    static 0 without a window (``_common.window_first_page``)."""
    if sliding_window is None:
        return 0
    return cm.window_first_page(length - 1, sliding_window, page_size)


def _decode_mask(key, length, sliding_window: int | None):
    """True for the keys the decode query (at length - 1) attends: below length, and in its window if any."""
    if sliding_window is None:
        return key < length
    return cm.in_window(key < length, key, length - 1, sliding_window)


# --------------------------------------------------------------------------------------------- TPU


def _tpu_kernel(
    lengths_ref,  # SMEM i32[num_seqs]
    table_ref,  # SMEM i32[num_seqs * pages_per_seq]
    layer_ref,  # SMEM i32[1], or i32[2] [layer, window] with a traced window
    q_ref,  # VMEM [group, head_dim]
    *refs,  # with sinks their VMEM f32[group, 1] first; the pool's (``_tpu_paging.open_stream``), o_ref among them
    sm_scale: float,
    pages_per_seq: int,
    page_size: int,
    quantized: bool,
    sliding_window: int | None,
    logit_softcap: float | None,
    has_sinks: bool,
):
    sinks_ref, refs = cm.split_sinks_ref(refs, has_sinks)
    seq, head = pl.program_id(0), pl.program_id(1)
    length = lengths_ref[seq]
    sliding_window = cm.kernel_window(sliding_window, layer_ref)
    first_page = _window_first_page(length, sliding_window, page_size)
    stream, o_ref = open_stream(
        refs, quantized=quantized, table_ref=table_ref, table_row=seq, pages_per_seq=pages_per_seq,
        layer=layer_ref[0], head=head, num_pages=pl.cdiv(length, page_size), first_page=first_page,
    )
    block_tokens = stream.pages_per_block * page_size
    group, head_dim = q_ref.shape
    q = q_ref[...]
    # the one query token sits at position length - 1: it attends every key below length (in its window)
    row_pos = jnp.full((group, 1), length - 1, jnp.int32)
    step = functools.partial(
        cm.causal_block_step, row_pos=row_pos, length=length, kv_end=length, sm_scale=sm_scale,
        sliding_window=sliding_window, logit_softcap=logit_softcap,
    )

    def body(block, k, v, scales, state):
        first_key = cm.plus(block * block_tokens, first_page * page_size)
        return step(state, q, k, v, first_key=first_key, scales=scales)

    num_blocks = cm.blocks_from(first_page, length, page_size, stream.pages_per_block)
    state = fold_pages(stream, num_blocks, body, cm.init_softmax_state(group, head_dim, sinks_ref))
    o_ref[...] = cm.finalize(state).astype(o_ref.dtype)


def _paged_attention_tpu(q, k_pool, v_pool, k_scales, v_scales, layer, lengths, page_indices, geometry, *, sm_scale,
                         pages_per_block, sliding_window, logit_softcap, sinks, interpret):
    """Arrays as in ``paged_attention`` (validated, pools stacked, lengths clamped) -> [num_seqs, num_q_heads,
    head_dim]."""
    num_seqs, num_q_heads, head_dim = q.shape
    g = geometry
    pages_per_seq = page_indices.shape[1]
    group = num_q_heads // g.num_kv_heads
    q4 = q.reshape(num_seqs, g.num_kv_heads, group, head_dim)
    q_spec = pl.BlockSpec((None, None, group, head_dim), lambda s, h, *_: (s, h, 0, 0))
    kernel = functools.partial(
        _tpu_kernel, sm_scale=sm_scale, pages_per_seq=pages_per_seq, page_size=g.page_size,
        quantized=k_scales is not None, sliding_window=sliding_window, logit_softcap=logit_softcap,
        has_sinks=sinks is not None,
    )
    pool_specs, pool_arrays, scratch = stream_operands(
        k_pool, v_pool, k_scales, v_scales, layer, page_indices, g, pages_per_block
    )
    sink_specs, sink_arrays = cm.sink_operands(sinks, g.num_kv_heads, group, 1, lambda s, h, *_: (h, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(num_seqs, g.num_kv_heads),
            in_specs=[q_spec, *sink_specs, *pool_specs],
            out_specs=q_spec,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=cm.interpret_arg("tpu", interpret),
        name="paged_attention_tpu",
    )(lengths, page_indices.reshape(-1), layer, q4, *sink_arrays, *pool_arrays)
    return out.reshape(q.shape)


# --------------------------------------------------------------------------------------------- GPU


def _gpu_kernel(
    q_ref,  # [rows, head_dim], the KV group's query heads padded to rows (power of two >= 16)
    k_ref,  # [num_layers * num_kv_heads * total_pages, page_size, head_dim], the stacked pool's pages
    v_ref,  # [num_layers * num_kv_heads * total_pages, page_size, head_dim]
    # an int8 pool's scales f32[num_layers * num_kv_heads * total_pages, page_size] (k, v), then:
    # table_ref i32[pages_per_split], this split's slice of the block table; length_ref i32[1]; layer_ref i32[1]
    # (i32[2] [layer, window] with a traced window);
    # o_ref f32[rows, head_dim], unnormalised partial output; m_ref, l_ref f32[rows, 1], running max and sum
    *refs,
    quantized: bool,
    sm_scale: float,
    pages_per_block: int,
    num_kv_heads: int,
    total_pages: int,
    sliding_window: int | None,
    logit_softcap: float | None,
):
    (ks_ref, vs_ref), (table_ref, length_ref, layer_ref, o_ref, m_ref, l_ref) = cm.split_scale_refs(refs, quantized)
    split = pl.program_id(2)
    first_of_head = cm.first_page_of(layer_ref[0], pl.program_id(1), num_kv_heads, total_pages)
    sliding_window = cm.kernel_window(sliding_window, layer_ref)
    page_size, head_dim = k_ref.shape[1], k_ref.shape[2]
    pages_per_split = table_ref.shape[0]
    block_tokens = pages_per_block * page_size
    length = length_ref[0]
    first_page = split * pages_per_split
    end_page = jnp.minimum(pl.cdiv(length, page_size), first_page + pages_per_split)
    num_blocks = pl.cdiv(jnp.maximum(end_page - first_page, 0), pages_per_block)
    window_page = _window_first_page(length, sliding_window, page_size)
    first_block = cm.block_of_page(window_page, first_page, pages_per_block)
    q = q_ref[...]

    def body(block, state):
        first_in_block = first_page + block * pages_per_block
        pages = table_ref[pl.ds(block * pages_per_block, pages_per_block)]
        pages = first_of_head + cm.live_pages_only(pages, first_in_block, end_page)
        k = cm.kv_values(k_ref[pages].reshape(block_tokens, head_dim), q.dtype)
        v = cm.kv_values(v_ref[pages].reshape(block_tokens, head_dim), q.dtype)
        first = first_in_block * page_size
        token_row = first + jax.lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
        k_scale, v_scale = (cm.valid_scales(cm.gpu_token_scales(x, pages), token_row, length) for x in (ks_ref, vs_ref))
        s = cm.logits(q, k, sm_scale, logit_softcap, k_scale)  # f32[rows, block_tokens]
        key = first + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        mask = _decode_mask(key, length, sliding_window)
        token_ok = first + jax.lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0) < length
        return cm.online_softmax_step(state, s, mask, cm.zero_invalid_rows(v, token_ok), v_scale)

    state = cm.init_softmax_state(q_ref.shape[0], head_dim)
    m, denom, acc = jax.lax.fori_loop(first_block, num_blocks, body, state)
    o_ref[...], m_ref[...], l_ref[...] = acc, m, denom


def combine_splits(o, m, denom, sinks=None):
    """Merges split partials: o f32[..., splits, rows, d]; max m, sum denom f32[..., splits, rows, 1]; with
    ``sinks`` (f32[..., rows, 1], each row's sink logit) one more term in each row's denominator."""
    m_all = jnp.max(m, axis=-3, keepdims=True)
    if sinks is not None:
        m_all = jnp.maximum(m_all, sinks[..., None, :, :])
    weight = jnp.exp(m - m_all)
    l_all = jnp.sum(weight * denom, axis=-3)
    if sinks is not None:
        l_all = l_all + jnp.exp(sinks - m_all[..., 0, :, :])
    acc = jnp.sum(weight * o, axis=-3)
    return acc / jnp.where(l_all == 0.0, 1.0, l_all)


def split_partials(part_shape: tuple[int, ...], head_dim: int) -> dict:
    """The ``out_specs`` and ``out_shape`` of a flash-decoding GPU kernel whose grid is ``part_shape[:-1]`` (its last
    axis the split): per grid point f32 partials [rows, head_dim] (unnormalised output), [rows, 1] (max) and [rows, 1]
    (sum), as ``combine_splits`` takes them."""
    grid_rank = len(part_shape) - 1
    index = lambda *ids: (*ids, 0, 0)
    specs = [pl.BlockSpec((*(None,) * grid_rank, part_shape[-1], width), index) for width in (head_dim, 1, 1)]
    shapes = [jax.ShapeDtypeStruct((*part_shape, width), jnp.float32) for width in (head_dim, 1, 1)]
    return dict(out_specs=specs, out_shape=shapes)


def gpu_num_splits(num_splits, num_seqs, num_kv_heads, num_blocks) -> int:
    if num_splits is None:
        num_splits = pl.cdiv(GPU_TARGET_PROGRAMS, num_seqs * num_kv_heads)
    return max(1, min(num_splits, num_blocks))


def _paged_attention_gpu(
    q,
    k_pool,
    v_pool,
    k_scales,
    v_scales,
    layer,
    lengths,
    page_indices,
    geometry,
    *,
    sm_scale,
    pages_per_block,
    num_splits,
    num_warps,
    num_stages,
    sliding_window,
    logit_softcap,
    sinks,
    interpret,
):
    """Arrays as in ``paged_attention`` (validated, pools stacked, lengths clamped) -> [num_seqs, num_q_heads,
    head_dim]; the sinks join the splits' partials as they are combined (in XLA)."""
    num_seqs, num_q_heads, head_dim = q.shape
    g = geometry
    pages_per_seq = page_indices.shape[1]
    group = num_q_heads // g.num_kv_heads
    rows = max(16, cm.next_power_of_2(group))  # Triton dots need >= 16 rows
    num_splits = gpu_num_splits(num_splits, num_seqs, g.num_kv_heads, pl.cdiv(pages_per_seq, pages_per_block))
    pages_per_split = pl.cdiv(pl.cdiv(pages_per_seq, num_splits), pages_per_block) * pages_per_block
    # Padding entries point at page 0; they lie past every length and are masked.
    table = jnp.pad(page_indices, ((0, 0), (0, num_splits * pages_per_split - pages_per_seq)))
    table = table.reshape(num_seqs, num_splits, pages_per_split)
    q4 = q.reshape(num_seqs, g.num_kv_heads, group, head_dim)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    pool_specs, pool_arrays = cm.gpu_pool_operands(k_pool, v_pool, k_scales, v_scales)
    part_shape = (num_seqs, g.num_kv_heads, num_splits, rows)
    kernel = functools.partial(
        _gpu_kernel, quantized=k_scales is not None, sm_scale=sm_scale, pages_per_block=pages_per_block,
        num_kv_heads=g.num_kv_heads, total_pages=g.total_pages, sliding_window=sliding_window,
        logit_softcap=logit_softcap,
    )
    o, m, denom = pl.pallas_call(
        kernel,
        grid=(num_seqs, g.num_kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((None, None, rows, head_dim), lambda s, h, k: (s, h, 0, 0)),
            *pool_specs,
            pl.BlockSpec((None, None, pages_per_split), lambda s, h, k: (s, k, 0)),
            pl.BlockSpec((None, 1), lambda s, h, k: (s, 0)),
            pl.BlockSpec(layer.shape, lambda s, h, k: (0,)),
        ],
        **split_partials(part_shape, head_dim),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=cm.interpret_arg("gpu", interpret),
        name="paged_attention_gpu",
    )(q4, *pool_arrays, table, lengths.reshape(num_seqs, 1), layer)
    sinks = None if sinks is None else cm.sink_rows(sinks, g.num_kv_heads, rows, 1)  # [Hkv, rows, 1]
    out = combine_splits(o, m, denom, sinks)[:, :, :group]
    return out.reshape(q.shape).astype(q.dtype)


# ------------------------------------------------------------------------------------------ public


def _variants(sliding_window, logit_softcap, sinks, num_q_heads: int) -> dict:
    """The validated optional variants as keyword arguments of the kernel calls."""
    sliding_window, logit_softcap = cm.check_window_and_softcap(sliding_window, logit_softcap)
    return dict(sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=cm.check_sinks(sinks, num_q_heads))


def _validate(q, k_pool, v_pool, lengths, page_indices, k_scales, v_scales) -> cm.PoolGeometry:
    if q.ndim != 3:
        raise ValueError(f"q must be [num_seqs, num_q_heads, head_dim], got shape {q.shape}")
    geometry = cm.check_query_and_pool(q, k_pool, v_pool, "[num_seqs, num_q_heads, head_dim]", k_scales, v_scales)
    cm.check_int_vector("lengths", lengths, q.shape[0])
    cm.check_page_indices(page_indices, q.shape[0])
    return geometry


@cm.jit_with_window(
    static_argnames=(
        "sm_scale",
        "backend",
        "interpret",
        "pages_per_compute_block",
        "num_splits",
        "num_warps",
        "num_stages",
        "sliding_window",
        "logit_softcap",
    ),
)
def paged_attention(
    q: jax.Array,  # [num_seqs, num_q_heads, head_dim]
    k_pages: jax.Array,  # one layer [Hkv, total_pages, page_size, D] or stacked [L, Hkv, total_pages, rows, lanes]
    v_pages: jax.Array,  # like k_pages
    lengths: jax.Array,  # i32[num_seqs], context tokens per sequence
    page_indices: jax.Array,  # i32[num_seqs, pages_per_seq], block table
    *,
    layer: jax.Array | int | None = None,  # i32[]: the layer to read of a stacked pool
    sm_scale: float | None = None,
    backend: str = "auto",
    interpret: bool = False,
    pages_per_compute_block: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    sliding_window: int | jax.Array | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,  # f32[num_q_heads]: attention sinks (gpt-oss)
    k_scales: jax.Array | None = None,  # f32[L, Hkv, total_pages, page_size] ([Hkv, ...] for one layer): int8 pool
    v_scales: jax.Array | None = None,  # like k_scales
) -> jax.Array:  # [num_seqs, num_q_heads, head_dim], q.dtype
    """Decode attention of one query token per sequence over its paged context.

    Args:
      q, k_pages, v_pages, lengths, page_indices: see the shape comments. ``lengths`` above
        pages_per_seq * page_size are clamped to it; block-table entries past a sequence's length are
        never dereferenced. The pool is one layer's pages, or the engine's stacked pool of every layer
        (``_common.PoolGeometry``; the TPU variant also reads the lane-dense layout) read in place at
        ``layer``.
      layer: the layer of a stacked pool (None for a one-layer pool).
      sm_scale: softmax scale, default 1/sqrt(head_dim).
      backend: "tpu", "gpu" or "auto" (by ``jax.default_backend()``; on CPU, "auto" with interpret=True
        uses the TPU variant, without interpret it raises).
      interpret: run the kernel in the Pallas interpreter (CPU testing). For the TPU variant an
        ``pltpu.InterpretParams`` may be passed instead of True.
      pages_per_compute_block: pages per KV block (power of two; both backends). Default from
        ``TUNED_BLOCK_SIZES``; capped at the block table width.
      num_splits: GPU only, flash-decoding splits of the context; default fills ~1056 programs.
      num_warps, num_stages: GPU only, Triton launch parameters.
      sliding_window: attend only the last ``sliding_window`` keys (the query's own included); None or 0: all.
        A Python int is static (compiled in); an i32 scalar array is traced (one compiled call serves every
        layer's own window, 0 for none: ``_common.jit_with_window``).
      logit_softcap: soft-cap c of the scaled scores, c * tanh(s / c) (Gemma 2: 50.0); None or 0: no cap.
      sinks: a logit per query head, one more term of its softmax's denominator with no value (gpt-oss's
        attention sinks); None: none.
      k_scales, v_scales: with an int8 pool (and only then), the float32 scale of every token's K / V row
        per kv head, token t of page p at [..., p, t] whatever the pool's lane layout: K = k_pages value *
        k_scales (``_common``). Scales of pages and tokens past a sequence's length may hold anything.
    """
    geometry = _validate(q, k_pages, v_pages, lengths, page_indices, k_scales, v_scales)
    variants = _variants(sliding_window, logit_softcap, sinks, q.shape[1])
    k_pool, v_pool, k_scales, v_scales, layer_index = cm.stacked_kv(k_pages, v_pages, k_scales, v_scales, layer)
    variants["sliding_window"], layer_index = cm.window_in_layer(variants["sliding_window"], layer_index)
    backend = cm.resolve_backend(backend, interpret)
    page_size, head_dim = geometry.page_size, geometry.head_dim
    knobs = cm.tuned_knobs(
        TUNED_BLOCK_SIZES,
        (backend, page_size, head_dim),
        DEFAULT_BLOCK_SIZES[backend],
        pages_per_compute_block=pages_per_compute_block,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    cm.check_positive_power_of_2("pages_per_compute_block", knobs["pages_per_compute_block"])
    pages_per_seq = page_indices.shape[1]
    pages_per_block = cm.fit_pages_per_block(knobs["pages_per_compute_block"], pages_per_seq)
    sm_scale = cm.default_scale(sm_scale, head_dim)
    lengths = jnp.clip(lengths, 0, pages_per_seq * page_size)  # never walk past the block table
    args = (q, k_pool, v_pool, k_scales, v_scales, layer_index, lengths, page_indices, geometry)
    if backend == "tpu":
        cm.reject_knobs("tpu", num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)
        return _paged_attention_tpu(
            *args, sm_scale=sm_scale, pages_per_block=pages_per_block, interpret=interpret, **variants
        )
    cm.check_gpu_layout(geometry)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return _paged_attention_gpu(
        *args,
        sm_scale=sm_scale,
        pages_per_block=pages_per_block,
        num_splits=num_splits,
        num_warps=knobs["num_warps"],
        num_stages=knobs["num_stages"],
        interpret=interpret,
        **variants,
    )


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "logit_softcap"))
def paged_attention_reference(
    q: jax.Array,  # [num_seqs, num_q_heads, head_dim]
    k_pages: jax.Array,  # as in paged_attention
    v_pages: jax.Array,
    lengths: jax.Array,  # i32[num_seqs]
    page_indices: jax.Array,  # i32[num_seqs, pages_per_seq]
    *,
    layer: jax.Array | int | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:  # [num_seqs, num_q_heads, head_dim], q.dtype
    """Plain-jnp decode attention: gathers each sequence's pages through the block table (float32 math);
    ``sliding_window``, ``logit_softcap`` and an int8 pool's scales as in ``paged_attention``."""
    geometry = _validate(q, k_pages, v_pages, lengths, page_indices, k_scales, v_scales)
    sliding_window, logit_softcap = cm.check_window_and_softcap(sliding_window, logit_softcap)
    k_pages, v_pages = cm.reference_pages(k_pages, v_pages, layer, geometry, k_scales, v_scales)
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    sm_scale = cm.default_scale(sm_scale, head_dim)
    k, v = gather_pages(k_pages, page_indices), gather_pages(v_pages, page_indices)  # [s, kvh, T, d]
    key = jnp.arange(k.shape[2])[None, :]
    valid = key < lengths[:, None]  # [s, T]
    k = jnp.where(valid[:, None, :, None], k, 0.0)
    v = jnp.where(valid[:, None, :, None], v, 0.0)
    seen = _decode_mask(key, lengths[:, None], sliding_window)
    qg = q.astype(jnp.float32).reshape(num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    s = cm.softcap(jnp.einsum("shgd,shtd->shgt", qg, k) * sm_scale, logit_softcap)
    s = jnp.where(seen[:, None, None, :], s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True, initial=cm.MASK_VALUE))
    out = jnp.einsum("shgt,shtd->shgd", p, v) / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    return out.reshape(q.shape).astype(q.dtype)


def gather_pages(pages: jax.Array, page_indices: jax.Array) -> jax.Array:
    """pages [kvh, total_pages, page_size, d], page_indices i32[s, P] -> f32[s, kvh, P * page_size, d]."""
    num_kv_heads, _, page_size, head_dim = pages.shape
    num_seqs, pages_per_seq = page_indices.shape
    g = pages[:, page_indices].astype(jnp.float32)  # [kvh, s, P, page_size, d]
    return g.reshape(num_kv_heads, num_seqs, pages_per_seq * page_size, head_dim).transpose(1, 0, 2, 3)
