"""Attention over the paged KV pool: batch metadata, K/V writes, and the backend registry.

The model calls `write_kv` to scatter a step's new keys and values into its layer of the pool, then
`backend.attend(...)` to attend each query token over its sequence's cached context. Backends:
"reference" (plain XLA, gathers pages through the block table) and "pallas" (the kernels in
`kernels_pallas`, imported lazily).

The pool is one array per K and V for all layers, `[num_layers, num_kv_heads, num_blocks, block_size,
head_dim]`; a layer's slice is the kernels' page layout. The layers' scan carries the whole pool and
indexes it with the layer number, so writes update the donated buffer in place and reads gather only the
pages of the block tables: the step never copies the pool.
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class AttentionMetadata:
    """Per-step batch layout, passed into the jitted step as an explicit pytree.

    A step is a padded batch of `S` sequences with `Q` query tokens each (Q == 1 for decode).
    Query token `i` of sequence `s` sits at position `q_start[s] + i`; tokens at positions
    `>= lengths[s]` are padding (not written to the pool, their outputs are garbage).
    """

    block_tables: jax.Array  # i32[S, pages_per_seq]
    q_start: jax.Array  # i32[S], position of each sequence's first query token
    lengths: jax.Array  # i32[S], context length after this step (q_start + real query tokens)


def token_positions(q_start: jax.Array, num_query_tokens: int) -> jax.Array:
    """i32[S, Q]: the position of every query slot of the padded batch."""
    return q_start[:, None] + jnp.arange(num_query_tokens, dtype=jnp.int32)[None, :]


def slot_mapping(meta: AttentionMetadata, num_query_tokens: int, block_size: int, num_slots: int) -> jax.Array:
    """i32[S*Q]: flat pool slot of each query token; padding tokens map to `num_slots` (dropped)."""
    positions = token_positions(meta.q_start, num_query_tokens)
    block_idx = jnp.take_along_axis(meta.block_tables, positions // block_size, axis=1, mode="clip")
    slots = block_idx * block_size + positions % block_size
    valid = positions < meta.lengths[:, None]
    return jnp.where(valid, slots, num_slots).reshape(-1)


def write_kv(
    k_pool: jax.Array,  # [L, Hkv, num_blocks, block_size, D]
    v_pool: jax.Array,  # [L, Hkv, num_blocks, block_size, D]
    layer: jax.Array,  # i32[], the layer whose pages are written
    k: jax.Array,  # [S, Q, Hkv, D]
    v: jax.Array,  # [S, Q, Hkv, D]
    meta: AttentionMetadata,
) -> tuple[jax.Array, jax.Array]:
    """Scatters the step's new K/V into one layer of the pool, in place; padding tokens are dropped."""
    num_layers, num_kv_heads, num_blocks, block_size, head_dim = k_pool.shape
    num_slots = num_blocks * block_size
    slots = slot_mapping(meta, k.shape[1], block_size, num_slots)

    def scatter(pool: jax.Array, new: jax.Array) -> jax.Array:
        flat = pool.reshape(num_layers, num_kv_heads, num_slots, head_dim)
        new = new.reshape(-1, num_kv_heads, head_dim).astype(pool.dtype)  # [S*Q, Hkv, D], index order
        return flat.at[layer, :, slots].set(new, mode="drop").reshape(pool.shape)

    return scatter(k_pool, k), scatter(v_pool, v)


def gather_context(pool: jax.Array, layer: jax.Array, block_tables: jax.Array) -> jax.Array:
    """[S, Hkv, P * block_size, D]: one layer's pages of every sequence's block table, in position order."""
    _, num_kv_heads, _, block_size, head_dim = pool.shape
    num_seqs, pages_per_seq = block_tables.shape
    pages = pool[layer, :, block_tables]  # one gather: [S, P, Hkv, block_size, D]
    return pages.transpose(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, pages_per_seq * block_size, head_dim)


class AttentionBackend(Protocol):
    name: str

    def attend(
        self,
        q: jax.Array,  # [S, Q, Hq, D]
        k_pool: jax.Array,  # [L, Hkv, num_blocks, block_size, D]
        v_pool: jax.Array,  # [L, Hkv, num_blocks, block_size, D]
        layer: jax.Array,  # i32[]
        meta: AttentionMetadata,
        *,
        sm_scale: float,
        sliding_window: int | None,
    ) -> jax.Array: ...  # [S, Q, Hq, D]


class ReferenceBackend:
    """Plain XLA: gather the block tables' pages of one layer, mask, softmax in float32."""

    name = "reference"

    def attend(self, q, k_pool, v_pool, layer, meta, *, sm_scale, sliding_window=None):
        from kernels_pallas.prefill_attention import causal_attention

        k = gather_context(k_pool, layer, meta.block_tables)
        v = gather_context(v_pool, layer, meta.block_tables)
        return causal_attention(
            q, k, v, meta.q_start, meta.lengths, sm_scale=sm_scale, sliding_window=sliding_window
        )


class PallasBackend:
    """The Pallas kernels: `paged_attention` for decode (Q == 1), `prefill_attention` otherwise.

    The kernels take one layer's pages; slicing the layer out of the stacked pool costs a copy of that
    layer per step on the device (kernels that index the stacked pool directly are a follow-up)."""

    name = "pallas"

    def __init__(self, *, interpret: bool = False):
        self.interpret = interpret

    def attend(self, q, k_pool, v_pool, layer, meta, *, sm_scale, sliding_window=None):
        import kernels_pallas

        if sliding_window is not None:
            raise ValueError("the pallas attention backend does not support sliding-window attention")
        k_pages, v_pages = k_pool[layer], v_pool[layer]
        if q.shape[1] == 1:
            lengths = jnp.maximum(meta.lengths, 1)  # padding rows (length 0) read one harmless slot
            out = kernels_pallas.paged_attention(
                q[:, 0], k_pages, v_pages, lengths, meta.block_tables,
                sm_scale=sm_scale, interpret=self.interpret,
            )
            return out[:, None]
        return kernels_pallas.prefill_attention(
            q, k_pages, v_pages, meta.block_tables, meta.q_start, meta.lengths,
            sm_scale=sm_scale, interpret=self.interpret,
        )


ATTENTION_BACKENDS = ("reference", "pallas")


@functools.cache
def get_attention_backend(name: str, *, interpret: bool = False) -> AttentionBackend:
    """Backend by name; "auto" is pallas on GPU/TPU and reference on CPU."""
    if name == "auto":
        name = "reference" if jax.default_backend() == "cpu" else "pallas"
    if name == "reference":
        return ReferenceBackend()
    if name == "pallas":
        return PallasBackend(interpret=interpret or jax.default_backend() == "cpu")
    raise ValueError(f"unknown attention backend {name!r}; choose one of: auto, {', '.join(ATTENTION_BACKENDS)}")
