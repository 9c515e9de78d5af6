"""Attention backends: how a model attends each query token over its sequence's cached context.

The model calls `write_kv` (`kv_cache.py`) to scatter a step's new keys and values into its layer of the
pool, then `backend.attend(...)`. Backends: "reference" (plain XLA, gathers pages through the block
table), "pallas" (the kernels in `kernels_pallas`, imported lazily; they read the stacked pool at the layer
index) and "cpu" (the native XLA:CPU kernel of `kernels_cpu`, ragged itself; the default on CPU).
`get_attention_backend` picks one by name and platform.
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp

from jaxserve.attention.kv_cache import FP8_KV_DTYPE, ScaledPages, gather_context, page_values, pool_values
from jaxserve.attention.metadata import AttentionMetadata, per_token_rows, token_positions
from jaxserve.logger import init_logger
from jaxserve.math_utils import cdiv, round_up

logger = init_logger("jaxserve.attention.backends")


class AttentionBackend(Protocol):
    name: str

    kv_writes: str  # how write_kv puts the new K/V into the pool for it (`kv_cache.KV_WRITES`)

    def tokens_per_row(self, block_size: int, head_dim: int) -> int: ...  # of the pool layout it reads

    def attend(
        self,
        q: jax.Array,  # [S, Q, Hq, D] (a ragged step: [1, T, Hq, D])
        k_pool: jax.Array,  # [L, Hkv, num_blocks, block_size, D], or ScaledPages (an int8 pool)
        v_pool: jax.Array,  # as k_pool
        layer: jax.Array,  # i32[]
        meta: AttentionMetadata,
        *,
        sm_scale: float,
        # a static W, None, or a traced i32 scalar (0: none): a model of sliding and full layers passes each
        # layer's own window from inside its layer scan, and every layer attends once
        sliding_window: int | jax.Array | None,
        logit_softcap: float | None = None,  # scores become cap * tanh(score / cap) before masking
        sinks: jax.Array | None = None,  # f32[Hq]: a logit per query head in each softmax's denominator (gpt-oss)
    ) -> jax.Array: ...  # q's shape

    def attend_latent(
        self,
        q: jax.Array,  # [S, Q, H, W]: each head's absorbed query [q_lat | q_pe | zeros] (`models/deepseek.py`)
        pool: jax.Array,  # [L, 1, num_blocks, block_size, W]: rows [c | k_pe | zeros], keys and values alike
        layer: jax.Array,  # i32[]
        meta: AttentionMetadata,
        *,
        sm_scale: float,
        kv_lora_rank: int,
    ) -> jax.Array: ...  # [S, Q, H, kv_lora_rank]: each head's softmax-weighted sum of the rows' latents


def window_mask(keys: jax.Array, rows: jax.Array, sliding_window: int | jax.Array | None) -> jax.Array | bool:
    """Which keys a query at position ``rows`` sees in its sliding window (rows - W < key): True for all without
    one (None, or a traced 0)."""
    if sliding_window is None:
        return True
    if isinstance(sliding_window, int):
        return keys > rows - sliding_window
    return (sliding_window <= 0) | (keys > rows - sliding_window)


def attend_over_rows(backend: AttentionBackend, q, pool, layer, meta, *, sm_scale, kv_lora_rank):
    """`AttentionBackend.attend_latent` by the backend's own attention, with the pool as its keys and its values."""
    out = backend.attend(q, pool, pool, layer, meta, sm_scale=sm_scale, sliding_window=None)
    return out[..., :kv_lora_rank]


class ReferenceBackend:
    """Plain XLA paged attention: an online-softmax loop over chunks of each block table.

    The loop runs only as far as the longest sequence of its group of rows (a dynamic trip count), so a
    decode step on a 2048-token context bucket whose sequences hold 200 tokens reads about 200 tokens per
    sequence, not 2048. Large decode batches are split into groups of `group_rows` rows, each looping to
    its own longest sequence; the engine orders decode rows by length so that groups are homogeneous.
    Each chunk gathers `chunk_pages` pages of one layer straight from the stacked pool. With a
    ``logit_softcap`` c, the scaled scores become c * tanh(score / c) before masking (Gemma 2).
    """

    name = "reference"
    kv_writes = "rows"  # one XLA scatter of a [kv heads, head_dim] window per token (see write_kv)

    def __init__(self, chunk_tokens: int = 256, group_rows: int = 8):
        self.chunk_tokens = chunk_tokens
        self.group_rows = group_rows

    def tokens_per_row(self, block_size: int, head_dim: int) -> int:
        return 1

    def attend(self, q, k_pool, v_pool, layer, meta, *, sm_scale, sliding_window=None, logit_softcap=None,
               sinks=None):
        block_size = page_values(k_pool).shape[3]
        chunk_pages = max(1, min(self.chunk_tokens // block_size, meta.block_tables.shape[1]))
        attend_rows = lambda q, meta: chunked_paged_attention(
            q, k_pool, v_pool, layer, meta, chunk_pages=chunk_pages,
            sm_scale=sm_scale, sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks,
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

    attend_latent = attend_over_rows


def chunked_paged_attention(
    q, k_pool, v_pool, layer, meta, *, chunk_pages, sm_scale, sliding_window=None, logit_softcap=None, sinks=None
):
    """q [S, Q, Hq, D] attends causally over its sequence's pages (the last ``sliding_window`` tokens if set,
    static or traced: `window_mask`);
    with ``logit_softcap`` c, each score s = (q . k) * sm_scale becomes c * tanh(s / c) before masking; with
    ``sinks``, head h's running softmax starts on its sink (max sinks[h], denominator 1). Returns [S, Q, Hq, D]
    (padding rows 0)."""
    num_seqs, num_q, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = page_values(k_pool).shape
    chunk_len = chunk_pages * block_size
    pages_per_seq = meta.block_tables.shape[1]
    padded_pages = round_up(pages_per_seq, chunk_pages)
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
        mask = (keys <= rows) & (keys < lengths) & window_mask(keys, rows, sliding_window)
        scores = jnp.einsum("sqhgd,shtd->shgqt", qg, k) * sm_scale
        if logit_softcap:
            scores = logit_softcap * jnp.tanh(scores / logit_softcap)
        scores = jnp.where(mask, scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(scores - m_safe[..., None])
        scale = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        v = jnp.where(keys[0, 0, 0, 0][None, None, :, None] < meta.lengths[:, None, None, None], v, 0.0)
        acc = acc * scale[..., None] + jnp.einsum("shgqt,shtd->shgqd", p, v)
        return m_new, denom * scale + p.sum(axis=-1), acc

    group = num_q_heads // num_kv_heads
    state_shape = (num_seqs, num_kv_heads, group, num_q)
    if sinks is None:
        m0, denom0 = jnp.full(state_shape, -jnp.inf, jnp.float32), jnp.zeros(state_shape, jnp.float32)
    else:
        m0 = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(num_kv_heads, group, 1), state_shape)
        denom0 = jnp.ones(state_shape, jnp.float32)
    init = (
        m0,
        denom0,
        jnp.zeros((num_seqs, num_kv_heads, group, num_q, head_dim), jnp.float32),
    )
    num_chunks = cdiv(jnp.max(meta.lengths), chunk_len)
    _, denom, acc = jax.lax.fori_loop(0, num_chunks, chunk, init)
    out = acc / jnp.maximum(denom, 1e-30)[..., None]  # [S, Hkv, G, Q, D]
    out = out.transpose(0, 3, 1, 2, 4).reshape(q.shape)
    valid = token_positions(meta.q_start, num_q) < meta.lengths[:, None]
    return jnp.where(valid[..., None, None], out, 0.0).astype(q.dtype)


class PallasBackend:
    """The Pallas kernels: `paged_attention` for decode (Q == 1), `prefill_attention` for prefill chunks and
    `ragged_paged_attention` for mixed steps. They read the stacked pool in place at the layer index. A pool of
    latents (MLA): `mla_decode_attention` for decode; mixed steps (and prefill chunks, which DeepSeek's model attends in
    the expanded form unless asked for the absorbed one) in plain XLA, the reference backend's loop over the block
    table, until a latent kernel takes queries of many tokens.

    ``platform`` is where the step runs: "tpu" (Mosaic kernels, lane-dense pool), "gpu"/"cuda"/"rocm"
    (Triton kernels), or "cpu", where the TPU variant runs in the Pallas interpreter (tests)."""

    name = "pallas"
    kv_writes = "head_windows"

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

    def attend(self, q, k_pool, v_pool, layer, meta, *, sm_scale, sliding_window=None, logit_softcap=None,
               sinks=None):
        import kernels_pallas

        common = dict(layer=layer, sm_scale=sm_scale, interpret=self.interpret, backend=self.kernel_variant,
                      sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks,
                      **pool_scales(k_pool, v_pool))
        # uint16 pools (bfloat16 bits) exist only on XLA:CPU, where the kernels run interpreted
        k_pool, v_pool = pool_values(page_values(k_pool)), pool_values(page_values(v_pool))
        # the kernels take q in the pool's dtype, or as it is over a float8 or int8 pool (they widen its pages)
        query = q if k_pool.dtype in (FP8_KV_DTYPE, jnp.int8) else q.astype(k_pool.dtype)
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

    def attend_latent(self, q, pool, layer, meta, *, sm_scale, kv_lora_rank):
        if meta.is_ragged or q.shape[1] != 1:
            return ReferenceBackend().attend_latent(q, pool, layer, meta, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank)
        import kernels_pallas

        pool = pool_values(pool)  # uint16 pools (bfloat16 bits) exist only on XLA:CPU, where the kernels interpret
        query = q[:, 0] if pool.dtype == FP8_KV_DTYPE else q[:, 0].astype(pool.dtype)
        lengths = jnp.maximum(meta.lengths, 1)  # padding rows (length 0) read one harmless slot
        out = kernels_pallas.mla_decode_attention(
            query, pool, lengths, meta.block_tables, kv_lora_rank=kv_lora_rank, layer=layer,
            sm_scale=sm_scale, backend=self.kernel_variant, interpret=self.interpret,
        )
        return out[:, None].astype(q.dtype)


class CpuBackend(ReferenceBackend):
    """XLA:CPU: decode steps and prefill chunks call the native kernel of `kernels_cpu`, which reads the pages
    in place (plain XLA first copies every page through a slow gather) and attends only up to each token's
    position, when the pool is float32 or bfloat16 (or its uint16 bits); pools of other dtypes, and heads the kernel
    does not take (more than `kernels_cpu.MAX_GROUP` query heads per kv head, head_dim over `MAX_HEAD_DIM`: a real
    DeepSeek's latent attention), take the plain-XLA path of `ReferenceBackend`. Both apply the sliding window and
    the logit soft-cap."""

    name = "cpu"
    kv_writes = "native"  # the kernel library's custom call: nothing for XLA to compile per layer

    def __init__(self, **chunking):
        import kernels_cpu

        super().__init__(**chunking)
        kernels_cpu.require("the cpu attention backend's kernel")  # builds and registers it (once per process)

    def attend(self, q, k_pool, v_pool, layer, meta, *, sm_scale, sliding_window=None, logit_softcap=None,
               sinks=None):
        import kernels_cpu

        options = dict(sm_scale=sm_scale, sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks)
        pool_dtype = page_values(k_pool).dtype
        if (pool_dtype not in kernels_cpu.POOL_DTYPES or page_values(v_pool).dtype != pool_dtype
                or not _native_heads(q.shape[2], page_values(k_pool).shape[1], page_values(k_pool).shape[-1])):
            return super().attend(q, k_pool, v_pool, layer, meta, **options)
        options.update(pool_scales(k_pool, v_pool))
        k_pool, v_pool = page_values(k_pool), page_values(v_pool)
        if meta.is_ragged:
            out = kernels_cpu.paged_attention(
                q[0], k_pool, v_pool, layer, meta.block_tables, meta.query_starts, meta.query_lens, meta.q_start,
                meta.lengths, **options,
            )[None]
        else:
            out = kernels_cpu.padded_paged_attention(
                q, k_pool, v_pool, layer, meta.block_tables, meta.q_start, meta.lengths, **options,
            )
        return out.astype(q.dtype)


def _native_heads(num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the native CPU kernel takes these heads (`kernels_cpu.MAX_GROUP`, `MAX_HEAD_DIM`)."""
    import kernels_cpu

    return num_q_heads // num_kv_heads <= kernels_cpu.MAX_GROUP and head_dim <= kernels_cpu.MAX_HEAD_DIM


def pool_scales(k_pool, v_pool) -> dict:
    """The kernels' ``k_scales`` / ``v_scales`` arguments of an int8 pool (`ScaledPages`); none for other pools."""
    if not isinstance(k_pool, ScaledPages):
        return {}
    return {"k_scales": k_pool.scales, "v_scales": v_pool.scales}


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
