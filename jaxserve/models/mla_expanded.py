"""Latent attention in the expanded form, for prefill chunks: the context's latents expanded to per-head keys and
values, then ordinary causal multi-head attention.

Place in the data flow: `deepseek.MLAttention` calls `expanded_attention` in a prefill step (queries of many tokens
per sequence, padded rows) after the chunk's [latent | rotary key] rows are written into the pool; decode and mixed
steps attend in the weight-absorbed form (`AttentionBackend.attend_latent`).

Per head, with W_UK [r, nope] and W_UV [r, v] its slices of kv_b_proj: keys [W_UK^T c_t | k_pe_t] and values
W_UV^T c_t of every context token t, scores against [q_nope | q_pe]. The same attention as the absorbed form's
(q_nope . W_UK^T c = (W_UK q_nope) . c), at head dim nope + dr instead of r + dr, and values of v instead of r: for a
chunk of Q tokens over C of context it does 2 C r H (nope + v) multiply-adds more to expand the context and
Q C H (2 r - nope - v) fewer in the attention, fewer in all for any first chunk and any chunk of more than ~170
tokens at DeepSeek's shapes (`scripts/bench_mla_prefill.py` measures both forms: the expanded one 2.2-3.8x faster on
a 2-core EPYC at V2-Lite's shape). As the reference backend does, it walks each sequence's block table in chunks of
pages with an online softmax, gathering and expanding one chunk of the context at a time (no [C, H, nope] array of
the whole context), only as far as the longest sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.attention.kv_cache import gather_context
from jaxserve.attention.metadata import AttentionMetadata, token_positions
from jaxserve.config.mla_config import MLAConfig
from jaxserve.math_utils import cdiv, round_up
from jaxserve.models.common import einsum_f32

CHUNK_TOKENS = 256  # context tokens gathered and expanded at a time


def _expanded_chunk(rows: jax.Array, w_kv: jax.Array, mla: MLAConfig, dtype):
    """(keys' nope part [S, T, H, nope], rotary keys [S, T, dr], values [S, T, H, v]) of latent rows [S, T, W]."""
    nope, rank = mla.qk_nope_head_dim, mla.kv_lora_rank
    latent = rows[..., :rank]
    k_nope = einsum_f32("str,rhd->sthd", latent, w_kv[..., :nope])
    values = einsum_f32("str,rhv->sthv", latent, w_kv[..., nope:])
    k_pe = rows[..., rank:rank + mla.qk_rope_head_dim]
    return k_nope.astype(dtype), k_pe.astype(dtype), values.astype(dtype)


def expanded_attention(q_nope: jax.Array, q_pe: jax.Array, k_pool: jax.Array, layer: jax.Array,
                       meta: AttentionMetadata, w_kv: jax.Array, mla: MLAConfig) -> jax.Array:
    """f32[S, Q, H, v]: each head's values of queries q_nope [S, Q, H, nope] and q_pe [S, Q, H, dr] (after rotary)
    attending causally over their sequences' rows of the latent pool [L, 1, blocks, block_size, W] at ``layer``
    (the chunk's own already written); w_kv [r, H, nope + v] is kv_b_proj by head. Padding slots give zeros."""
    num_seqs, num_q, num_heads, _ = q_nope.shape
    block_size = k_pool.shape[3]
    chunk_pages = max(1, min(CHUNK_TOKENS // block_size, meta.block_tables.shape[1]))
    chunk_len = chunk_pages * block_size
    tables = jnp.pad(meta.block_tables, ((0, 0), (0, round_up(meta.block_tables.shape[1], chunk_pages)
                                                  - meta.block_tables.shape[1])))
    positions = token_positions(meta.q_start, num_q)[:, None, :, None]  # [S, 1, Q, 1]
    lengths = meta.lengths[:, None, None, None]

    def chunk(i, state):
        m, denom, acc = state
        pages = jax.lax.dynamic_slice_in_dim(tables, i * chunk_pages, chunk_pages, axis=1)
        keys = i * chunk_len + jnp.arange(chunk_len)  # [T]
        rows = gather_context(k_pool, layer, pages)[:, 0]  # [S, T, W]
        rows = jnp.where((keys[None, :] < meta.lengths[:, None])[..., None], rows, 0)  # no garbage past the context
        k_nope, k_pe, values = _expanded_chunk(rows, w_kv, mla, q_nope.dtype)
        scores = einsum_f32("sqhd,sthd->shqt", q_nope, k_nope) + einsum_f32("sqhd,std->shqt", q_pe, k_pe)
        scores = scores * mla.softmax_scale
        scores = jnp.where((keys <= positions) & (keys < lengths), scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(scores - m_safe[..., None])
        rescale = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        acc = acc * rescale[..., None] + einsum_f32("shqt,sthv->shqv", p, values)
        return m_new, denom * rescale + p.sum(axis=-1), acc

    shape = (num_seqs, num_heads, num_q)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, mla.v_head_dim), jnp.float32))
    _, denom, acc = jax.lax.fori_loop(0, cdiv(jnp.max(meta.lengths), chunk_len), chunk, init)
    out = (acc / jnp.maximum(denom, 1e-30)[..., None]).transpose(0, 2, 1, 3)  # [S, Q, H, v]
    valid = token_positions(meta.q_start, num_q) < meta.lengths[:, None]
    return jnp.where(valid[..., None, None], out, 0.0)
