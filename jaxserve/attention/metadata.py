"""A step's batch layout, the pytree every attention call and the sampler's per-token work read.

The runner builds `AttentionMetadata` from the step inputs (block tables, each row's first position and
length, and for a mixed step each row's first token in the flat input) and passes it into the jitted step.
A step's tokens are laid out padded (`[S, Q]`: prefill and decode buckets) or ragged (`[1, T]`: a mixed
step of decode rows and prefill chunks); `token_layout` maps every query slot to its row and position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxserve.reductions import count_true


@struct.dataclass
class AttentionMetadata:
    """Per-step batch layout, passed into the jitted step as an explicit pytree.

    A model with several KV cache groups (`config/kv_cache_groups.py`) gets the tables of every group; each layer
    attends with its group's (`for_kv_group`).

    Padded layout (``query_starts`` None): a batch of `S` rows with `Q` query tokens each (Q == 1 for
    decode), the model's input `[S, Q]`. Query token `i` of row `s` sits at position `q_start[s] + i`;
    tokens at positions `>= lengths[s]` are padding (not written to the pool, their outputs are garbage).

    Ragged layout (``query_starts`` given, a mixed step): the model's input is `[1, T]`, every row's query
    tokens back to back; row `s` is the `lengths[s] - q_start[s]` tokens from flat index `query_starts[s]`
    (non-decreasing; padding rows have no tokens: `q_start = lengths = 0`), at positions `q_start[s]`
    onwards. Flat tokens past every row are padding.
    """

    block_tables: jax.Array  # i32[S, pages_per_seq], or i32[G, S, pages_per_seq]: one per KV cache group
    q_start: jax.Array  # i32[S], position of each sequence's first query token
    lengths: jax.Array  # i32[S], context length after this step (q_start + real query tokens)
    query_starts: jax.Array | None = None  # i32[S], ragged layout only: flat index of each row's first token

    def for_kv_group(self, group) -> AttentionMetadata:
        """The metadata of a layer of KV cache group ``group`` (an int or i32[]): its group's block tables. A
        step of a model with one group carries `[S, P]` tables, every layer's."""
        if self.block_tables.ndim == 2:
            return self
        return self.replace(block_tables=self.block_tables[group])

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
    rows = count_true(flat[:, None] >= meta.query_starts[None, :], axis=1) - 1
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
