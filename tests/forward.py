"""Runs the Flax model directly over a paged KV pool, chunk by chunk, for parity tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention.backends import get_attention_backend
from jaxserve.attention.kv_cache import pool_of_kinds
from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.models import get_model_class
from jaxserve.models.common import unstack_layers
from jaxserve.runner.compiler_options import compiler_options


class PagedForward:
    def __init__(self, config, params, *, dtype="float32", block_size=4, num_blocks=32, backend="reference",
                 scan_layers=True):
        self.config, self.block_size = config, block_size
        self.params = params if scan_layers else unstack_layers(params, config.num_layers)
        self.model = get_model_class(config.architecture)(
            config, jnp.dtype(dtype), get_attention_backend(backend), scan_layers=scan_layers
        )
        # a model with several KV cache groups (sliding-window layers) gets each group's blocks in a part of its own
        self.num_groups, self.num_blocks = config.kv_cache_layout.num_groups, num_blocks
        layout = config.kv_cache_layout
        nan = lambda rows, heads, head_dim: jnp.full((rows, heads, num_blocks * self.num_groups, block_size, head_dim),
                                                     jnp.nan, jnp.dtype(dtype))  # unwritten slots are NaN: stray reads
        pairs = tuple((nan(layout.rows_of_kind(kind), *shape), nan(layout.rows_of_kind(kind), *shape))
                      for kind, shape in enumerate(config.kv_page_shapes))  # a (K, V) pair per page shape
        self.pool = pool_of_kinds(pairs)
        # the engine's XLA options for a program in this dtype (its runner's steps compile with them too)
        self._apply = jax.jit(self._forward, compiler_options=compiler_options(jax.default_backend(), dtype))

    def _forward(self, params, pool, ids, meta):
        hidden, pool = self.model.apply(params, ids, pool, meta)
        return self.model.apply(params, hidden, method=self.model.logits), pool

    def tables(self, block_table: list[int]) -> jax.Array:
        """One sequence's block tables: ``block_table``, or with G groups ``[G, 1, P]``, group g's blocks in the
        g-th part of the pool."""
        if self.num_groups == 1:
            return jnp.asarray([block_table], jnp.int32)
        return jnp.asarray([[[g * self.num_blocks + b for b in block_table]] for g in range(self.num_groups)],
                           jnp.int32)

    def lowered_decode_step(self, block_table: list[int], length: int) -> str:
        """The StableHLO text of one decode step of one sequence at ``length`` tokens (lowered, not run)."""
        meta = AttentionMetadata(block_tables=self.tables(block_table),
                                 q_start=jnp.asarray([length - 1], jnp.int32), lengths=jnp.asarray([length], jnp.int32))
        ids = jnp.zeros((1, 1), jnp.int32)
        return self._apply.lower(self.params, self.pool, ids, meta).as_text()

    def run(self, token_ids: list[int], block_table: list[int], chunks: list[int]) -> np.ndarray:
        """Feeds `token_ids` in chunks of the given sizes; returns the logits of every token [T, V]."""
        assert sum(chunks) == len(token_ids)
        out, start = [], 0
        table = self.tables(block_table)
        for size in chunks:
            ids = jnp.asarray([token_ids[start : start + size]], jnp.int32)
            meta = AttentionMetadata(
                block_tables=table, q_start=jnp.asarray([start], jnp.int32),
                lengths=jnp.asarray([start + size], jnp.int32),
            )
            logits, self.pool = self._apply(self.params, self.pool, ids, meta)
            out.append(np.asarray(logits[0]))
            start += size
        return np.concatenate(out)
