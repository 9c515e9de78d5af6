"""Decode attention of multi-head latent attention (MLA: DeepSeek-V2 / V3, Kimi K2) over the latent KV cache.

Place in the data flow: on a decode step of a latent model (`jaxserve/models/deepseek.py`), after the step's
latents are written into the pool, the attention backend calls ``mla_decode_attention`` once per layer with the
whole stacked pool and the layer index (read in place), the batch's block tables and context lengths. The result
goes through each head's value projection (W_UV) and o_proj.

The weight-absorbed form (vLLM's MLA): the pool keeps per token and layer one row [c | k_pe], the normed latent
(``kv_lora_rank`` r values) and the rotary key (dr values); each head's query arrives projected into that space,
[q_lat | q_pe] (r + dr values). A head's score against a token is its query . the token's row, and its output is
sum_t p_t c_t: [num_seqs, num_heads, r]. Every head attends the same rows (multi-query attention of head dim
r + dr) and the rows are the values too, so a kernel reads each page once for keys and values and all heads
(the generic kernels would read it twice, as K and as V, and need head_dim in 64 / 128 / 256).

Two Pallas variants:
* TPU (Mosaic): grid (sequence,). Lengths, block tables and the layer are scalar-prefetched; pages stay in HBM
  and are DMA'd into double-buffered VMEM blocks of ``pages_per_compute_block`` pages (``_tpu_paging``'s
  keys-only stream); scores [heads, block tokens] and the output [heads, r] with an online softmax.
* GPU (Triton): flash-decoding, grid (sequence, split): each split walks its share of the block table (pages by
  offset into the flattened stacked pool) and writes a partial (max, sum, output); XLA combines the splits.
  Triton's blocks are powers of two, so a row is read as its latent (r lanes) and its rotary part (dr lanes).

Tokens at positions >= length never influence the result, block-table entries past a sequence's length are
never dereferenced, and a sequence of length 0 gives zeros. A float8 pool (``kv_cache_dtype="fp8"``) is widened
to the query's dtype as it is read; an int8 pool has no latent form (its per-head scales).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import _common as cm
from kernels_pallas._tpu_paging import PageStream, fold_pages
from kernels_pallas.paged_attention import combine_splits, gpu_num_splits, split_partials

SUPPORTED_LATENT_RANKS = (128, 256, 512)  # whole TPU vregs of lanes, powers of two for Triton
SUPPORTED_ROPE_DIMS = (32, 64, 128)
MLA_POOL_DTYPES = cm.SUPPORTED_DTYPES + cm.FLOAT8_POOL_DTYPES
# Knobs per backend: a compute block of ~128 tokens (TPU) or ~32 (GPU, whose block of rows sits in shared memory);
# starting points, not yet measured on hardware.
BLOCK_TOKENS = {"tpu": 128, "gpu": 32}
DEFAULT_GPU_LAUNCH = {"num_warps": 4, "num_stages": 2}


# --------------------------------------------------------------------------------------------- TPU


def _tpu_kernel(
    lengths_ref,  # SMEM i32[num_seqs]
    table_ref,  # SMEM i32[num_seqs * pages_per_seq]
    layer_ref,  # SMEM i32[1]
    q_ref,  # VMEM [num_heads, r + dr]
    pool_hbm,  # HBM [num_layers, 1, total_pages, page_size, r + dr]
    o_ref,  # VMEM [num_heads, r]
    buf,  # VMEM [2, pages_per_block, page_size, r + dr]
    sems,  # DMA semaphores [2, 2]
    *,
    sm_scale: float,
    pages_per_seq: int,
    rank: int,
):
    seq = pl.program_id(0)
    length = lengths_ref[seq]
    page_size = buf.shape[2]
    stream = PageStream(pool_hbm, None, buf, None, sems, table_ref, table_offset=seq * pages_per_seq,
                        layer=layer_ref[0], head=0, num_pages=pl.cdiv(length, page_size))
    block_tokens = stream.pages_per_block * page_size
    q = q_ref[...]

    def body(block, rows, _values, _scales, state):
        return _latent_block_step(state, q, rows, block * block_tokens, length, sm_scale, rank)

    num_blocks = pl.cdiv(length, block_tokens)
    state = fold_pages(stream, num_blocks, body, cm.init_softmax_state(q.shape[0], rank))
    o_ref[...] = cm.finalize(state).astype(o_ref.dtype)


def _latent_block_step(state, q, rows, first_key, length, sm_scale: float, rank: int):
    """Online-softmax update of every head with one block of pool rows [block_tokens, r + dr] (tokens
    first_key..): scores against the whole rows, values their latents (rows at or past ``length`` zeroed)."""
    rows = cm.kv_values(rows, q.dtype)
    s = cm.logits(q, rows, sm_scale)  # f32[heads, block_tokens]
    key = first_key + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    token = first_key + jax.lax.broadcasted_iota(jnp.int32, (rows.shape[0], 1), 0)
    return cm.online_softmax_step(state, s, key < length, cm.zero_invalid_rows(rows[:, :rank], token < length))


def _mla_tpu(q, pool, layer, lengths, page_indices, *, sm_scale, rank, pages_per_block, interpret):
    """Arrays as in ``mla_decode_attention`` (validated, pool stacked, lengths clamped) -> [num_seqs, heads, r]."""
    num_seqs, num_heads, width = q.shape
    page_size = pool.shape[3]
    pages_per_seq = page_indices.shape[1]
    kernel = functools.partial(_tpu_kernel, sm_scale=sm_scale, pages_per_seq=pages_per_seq, rank=rank)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(num_seqs,),
            in_specs=[pl.BlockSpec((None, num_heads, width), lambda s, *_: (s, 0, 0)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((None, num_heads, rank), lambda s, *_: (s, 0, 0)),
            scratch_shapes=[pltpu.VMEM((2, pages_per_block, page_size, width), pool.dtype),
                            pltpu.SemaphoreType.DMA((2, 2))],
        ),
        out_shape=jax.ShapeDtypeStruct((num_seqs, num_heads, rank), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=cm.interpret_arg("tpu", interpret),
        name="mla_decode_attention_tpu",
    )(lengths, page_indices.reshape(-1), layer, q, pool)


# --------------------------------------------------------------------------------------------- GPU


def _gpu_kernel(
    q_ref,  # [rows, r + dr], the heads padded to rows (a power of two >= 16)
    pool_ref,  # [num_layers * total_pages, page_size, r + dr], the stacked pool's pages
    table_ref,  # i32[pages_per_split], this split's slice of the block table
    length_ref,  # i32[1]
    layer_ref,  # i32[1]
    o_ref,  # f32[rows, r], unnormalised partial output
    m_ref,  # f32[rows, 1], running max
    l_ref,  # f32[rows, 1], running sum
    *,
    sm_scale: float,
    pages_per_block: int,
    total_pages: int,
    rank: int,
):
    split = pl.program_id(1)
    page_size, width = pool_ref.shape[1], pool_ref.shape[2]
    rope = width - rank
    pages_per_split = table_ref.shape[0]
    block_tokens = pages_per_block * page_size
    length = length_ref[0]
    first_page = split * pages_per_split
    end_page = jnp.minimum(pl.cdiv(length, page_size), first_page + pages_per_split)
    num_blocks = pl.cdiv(jnp.maximum(end_page - first_page, 0), pages_per_block)
    q_lat, q_pe = q_ref[:, pl.ds(0, rank)], q_ref[:, pl.ds(rank, rope)]

    def body(block, state):
        first_in_block = first_page + block * pages_per_block
        pages = table_ref[pl.ds(block * pages_per_block, pages_per_block)]
        pages = layer_ref[0] * total_pages + cm.live_pages_only(pages, first_in_block, end_page)
        latent = cm.kv_values(pool_ref[pages, :, pl.ds(0, rank)].reshape(block_tokens, rank), q_lat.dtype)
        k_pe = cm.kv_values(pool_ref[pages, :, pl.ds(rank, rope)].reshape(block_tokens, rope), q_pe.dtype)
        s = cm.logits(q_lat, latent, sm_scale) + cm.logits(q_pe, k_pe, sm_scale)  # f32[rows, block_tokens]
        first = first_in_block * page_size
        key = first + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        token_ok = first + jax.lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0) < length
        return cm.online_softmax_step(state, s, key < length, cm.zero_invalid_rows(latent, token_ok))

    state = cm.init_softmax_state(q_ref.shape[0], rank)
    m, denom, acc = jax.lax.fori_loop(0, num_blocks, body, state)
    o_ref[...], m_ref[...], l_ref[...] = acc, m, denom


def _mla_gpu(q, pool, layer, lengths, page_indices, *, sm_scale, rank, pages_per_block, num_splits, num_warps,
             num_stages, interpret):
    """Arrays as in ``mla_decode_attention`` (validated, pool stacked, lengths clamped) -> [num_seqs, heads, r]."""
    num_seqs, num_heads, width = q.shape
    num_layers, _, total_pages = pool.shape[:3]
    pages_per_seq = page_indices.shape[1]
    rows = max(16, cm.next_power_of_2(num_heads))  # Triton dots need >= 16 rows
    num_splits = gpu_num_splits(num_splits, num_seqs, 1, pl.cdiv(pages_per_seq, pages_per_block))
    pages_per_split = pl.cdiv(pl.cdiv(pages_per_seq, num_splits), pages_per_block) * pages_per_block
    # Padding entries point at page 0; they lie past every length and are masked.
    table = jnp.pad(page_indices, ((0, 0), (0, num_splits * pages_per_split - pages_per_seq)))
    table = table.reshape(num_seqs, num_splits, pages_per_split)
    q_rows = jnp.pad(q, ((0, 0), (0, rows - num_heads), (0, 0)))
    pages = cm.flat_pages(pool)
    part_shape = (num_seqs, num_splits, rows)
    kernel = functools.partial(_gpu_kernel, sm_scale=sm_scale, pages_per_block=pages_per_block,
                               total_pages=total_pages, rank=rank)
    o, m, denom = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_splits),
        in_specs=[
            pl.BlockSpec((None, rows, width), lambda s, k: (s, 0, 0)),
            pl.BlockSpec(pages.shape, lambda s, k: (0, 0, 0)),
            pl.BlockSpec((None, None, pages_per_split), lambda s, k: (s, k, 0)),
            pl.BlockSpec((None, 1), lambda s, k: (s, 0)),
            pl.BlockSpec(layer.shape, lambda s, k: (0,)),
        ],
        **split_partials(part_shape, rank),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=cm.interpret_arg("gpu", interpret),
        name="mla_decode_attention_gpu",
    )(q_rows, pages, table, lengths.reshape(num_seqs, 1), layer)
    return combine_splits(o, m, denom)[:, :num_heads].astype(q.dtype)


# ------------------------------------------------------------------------------------------ public


def check_latent_shape(width: int, kv_lora_rank: int) -> None:
    """A ValueError unless rows of ``width`` values split into a supported latent rank and rotary part."""
    if kv_lora_rank not in SUPPORTED_LATENT_RANKS:
        raise ValueError(f"kv_lora_rank must be one of {SUPPORTED_LATENT_RANKS}, got {kv_lora_rank}")
    if width - kv_lora_rank not in SUPPORTED_ROPE_DIMS:
        raise ValueError(f"the rotary part of a latent row (its {width} values less kv_lora_rank {kv_lora_rank}) "
                         f"must be one of {SUPPORTED_ROPE_DIMS}, got {width - kv_lora_rank}")


def _validate(q, pool, lengths, page_indices, kv_lora_rank: int) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be [num_seqs, num_heads, kv_lora_rank + rope_dim], got shape {q.shape}")
    if pool.ndim not in (4, 5) or pool.shape[-4] != 1:
        raise ValueError("the latent pool must be one layer [1, total_pages, page_size, width] or the stacked pool "
                         f"[num_layers, 1, total_pages, page_size, width] (one kv head), got shape {pool.shape}")
    if pool.dtype not in MLA_POOL_DTYPES:
        raise ValueError(f"the latent pool's dtype must be float32, bfloat16 or float8_e4m3fn, got {pool.dtype}")
    if q.dtype not in cm.SUPPORTED_DTYPES or (pool.dtype in cm.SUPPORTED_DTYPES and q.dtype != pool.dtype):
        raise ValueError(f"q dtype ({q.dtype}) must be the pool's ({pool.dtype}), or float32 / bfloat16 over float8")
    if q.shape[-1] != pool.shape[-1]:
        raise ValueError(f"q's last dimension ({q.shape[-1]}) must match the pool rows' ({pool.shape[-1]})")
    check_latent_shape(pool.shape[-1], kv_lora_rank)
    if pool.shape[-2] not in cm.SUPPORTED_PAGE_SIZES:
        raise ValueError(f"page_size must be one of {cm.SUPPORTED_PAGE_SIZES}, got {pool.shape[-2]}")
    cm.check_int_vector("lengths", lengths, q.shape[0])
    cm.check_page_indices(page_indices, q.shape[0])


def _pages_per_block(backend: str, requested: int | None, page_size: int, pages_per_seq: int) -> int:
    pages = requested or max(1, BLOCK_TOKENS[backend] // page_size)
    cm.check_positive_power_of_2("pages_per_compute_block", pages)
    return cm.fit_pages_per_block(pages, pages_per_seq)


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "sm_scale", "backend", "interpret",
                                             "pages_per_compute_block", "num_splits", "num_warps", "num_stages"))
def mla_decode_attention(
    q: jax.Array,  # [num_seqs, num_heads, r + dr]: each head's absorbed query [q_lat | q_pe]
    pool: jax.Array,  # one layer [1, total_pages, page_size, r + dr] or stacked [L, 1, total_pages, page_size, r + dr]
    lengths: jax.Array,  # i32[num_seqs], context tokens per sequence
    page_indices: jax.Array,  # i32[num_seqs, pages_per_seq], block table
    *,
    kv_lora_rank: int,
    layer: jax.Array | int | None = None,  # i32[]: the layer to read of a stacked pool
    sm_scale: float | None = None,
    backend: str = "auto",
    interpret: bool = False,
    pages_per_compute_block: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:  # [num_seqs, num_heads, kv_lora_rank], q.dtype
    """Decode attention of one absorbed query token per sequence and head over its latent pages.

    Args:
      q, pool, lengths, page_indices: see the shape comments; a row of the pool is [c | k_pe], the first
        ``kv_lora_rank`` values the latent (the values attended). ``lengths`` above pages_per_seq * page_size are
        clamped to it; block-table entries past a sequence's length are never dereferenced.
      kv_lora_rank: r, one of ``SUPPORTED_LATENT_RANKS``; the rest of a row (one of ``SUPPORTED_ROPE_DIMS``) is
        the rotary key.
      layer: the layer of a stacked pool (None for a one-layer pool).
      sm_scale: softmax scale, default 1/sqrt(r + dr) (DeepSeek's is 1/sqrt(qk_head_dim) times its YaRN mscale^2).
      backend: "tpu", "gpu" or "auto" (as ``paged_attention``'s).
      interpret: run the kernel in the Pallas interpreter (CPU testing).
      pages_per_compute_block: pages per block of the walk (a power of two), default ~128 tokens (TPU) or ~32
        (GPU); capped at the block table width.
      num_splits, num_warps, num_stages: GPU only: flash-decoding splits (default: ~1056 programs) and Triton's
        launch parameters.
    """
    _validate(q, pool, lengths, page_indices, kv_lora_rank)
    pool, layer_index = cm.stacked_pool(pool, layer)
    backend = cm.resolve_backend(backend, interpret)
    pages_per_seq = page_indices.shape[1]
    pages_per_block = _pages_per_block(backend, pages_per_compute_block, pool.shape[3], pages_per_seq)
    lengths = jnp.clip(lengths, 0, pages_per_seq * pool.shape[3])  # never walk past the block table
    common = dict(sm_scale=cm.default_scale(sm_scale, q.shape[-1]), rank=kv_lora_rank,
                  pages_per_block=pages_per_block, interpret=interpret)
    if backend == "tpu":
        cm.reject_knobs("tpu", num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)
        return _mla_tpu(q, pool, layer_index, lengths, page_indices, **common)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    launch = {k: v if v is not None else DEFAULT_GPU_LAUNCH[k]
              for k, v in dict(num_warps=num_warps, num_stages=num_stages).items()}
    return _mla_gpu(q, pool, layer_index, lengths, page_indices, num_splits=num_splits, **launch, **common)


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "sm_scale"))
def mla_decode_attention_reference(q, pool, lengths, page_indices, *, kv_lora_rank: int, layer=None,
                                   sm_scale: float | None = None) -> jax.Array:
    """Plain-jnp ``mla_decode_attention``: gathers each sequence's rows through its block table (float32 math)."""
    _validate(q, pool, lengths, page_indices, kv_lora_rank)
    pool, layer_index = cm.stacked_pool(pool, layer)
    page_size = pool.shape[3]
    lengths = jnp.clip(lengths, 0, page_indices.shape[1] * page_size)
    rows = pool[layer_index[0], 0][page_indices].astype(jnp.float32)  # [S, P, page_size, r + dr]
    rows = rows.reshape(q.shape[0], -1, q.shape[-1])
    valid = jnp.arange(rows.shape[1])[None, :] < lengths[:, None]  # [S, T]
    rows = jnp.where(valid[..., None], rows, 0.0)
    s = jnp.einsum("shd,std->sht", q.astype(jnp.float32), rows) * cm.default_scale(sm_scale, q.shape[-1])
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True, initial=cm.MASK_VALUE))
    out = jnp.einsum("sht,str->shr", p, rows[..., :kv_lora_rank])
    return (out / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)).astype(q.dtype)
