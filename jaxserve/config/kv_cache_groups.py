"""KV cache groups: which layers share a block table, and how many blocks a request holds (no JAX).

vLLM V1's hybrid layout. Layers are grouped by what their cache keeps: full-attention layers every token,
sliding-window layers only the tokens their window still reaches. All groups have the same number of layers
(``layers_per_group``: the fewest layers of one kind, vLLM's rule), so a block of the pool is the same size in
every group and one free list serves them all: the pool is ``[layers_per_group, Hkv, num_blocks, ...]``, and a
block id belongs to one group at a time. Layer ``l`` reads and writes pool row ``slot_of[l]`` through the block
table of group ``group_of[l]``; a group shorter than the others leaves its last rows unused.

Gemma 3 270M (3 full, 15 sliding layers of 18) is 6 groups of 3 layers: one full group and five sliding ones, so
a request of 8,192 tokens holds 512 blocks of 16 in the full group and about 35 in each sliding group instead of
512 in every layer. A model whose layers are all alike is one group: the pool and the tables as before.

The ``BlockManager`` keeps one block table per group (`Sequence.block_tables`) and frees a sliding group's blocks
once no future query can reach them (`first_kept_token`); the step's inputs carry the tables as ``[G, S, P]``.
"""

from __future__ import annotations

import dataclasses
import functools


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)``: `jaxserve.math_utils.cdiv`, which this leaf of the layers cannot import (a group of its own
    layer)."""
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class KVCacheGroup:
    """Layers (model layer numbers, in pool-row order) that share one block table; ``sliding_window`` None: a
    full-attention group, which keeps every token."""

    layers: tuple[int, ...]
    sliding_window: int | None = None


@dataclasses.dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def layers_per_group(self) -> int:
        """Rows of the pool: the most layers of one group."""
        return max(len(group.layers) for group in self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.sliding_window for group in self.groups)

    @functools.cached_property
    def group_of(self) -> tuple[int, ...]:
        """Per model layer: its group."""
        return self._per_layer(lambda g, _slot: g)

    @functools.cached_property
    def slot_of(self) -> tuple[int, ...]:
        """Per model layer: its row of the pool."""
        return self._per_layer(lambda _g, slot: slot)

    def _per_layer(self, value) -> tuple[int, ...]:
        place = {layer: value(g, slot)
                 for g, group in enumerate(self.groups) for slot, layer in enumerate(group.layers)}
        return tuple(place[layer] for layer in range(len(place)))

    def blocks_per_request(self, num_tokens: int, block_size: int, max_chunk_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds at once, over every group: all of its
        blocks in a full group; in a sliding group what it keeps (`first_kept_token`) and the chunk it computes, at
        most."""
        return sum(blocks_per_request(group.sliding_window, num_tokens, block_size, max_chunk_tokens)
                   for group in self.groups)

    def max_concurrency(self, num_blocks: int, num_tokens: int, block_size: int, max_chunk_tokens: int) -> float:
        """How many requests of ``num_tokens`` tokens a pool of ``num_blocks`` holds at once: each keeps all its
        blocks in a full group and its window in a sliding one; a step's prompt chunks (``max_chunk_tokens`` over
        all its rows) hold more of each sliding group once, not per request."""
        per_request = self.blocks_per_request(num_tokens, block_size, 0)
        in_flight = sum(cdiv(max_chunk_tokens, block_size) + 1 for window in self.windows if window is not None)
        return max(0, num_blocks - in_flight) / per_request


def blocks_per_request(sliding_window: int | None, num_tokens: int, block_size: int, max_chunk_tokens: int) -> int:
    """One group's share of `KVCacheLayout.blocks_per_request`."""
    full = cdiv(num_tokens, block_size)
    if sliding_window is None:
        return full
    reach = sliding_window + 1 + max_chunk_tokens  # the kept tokens (`first_kept_token`) and the chunk being written
    return min(full, cdiv(reach, block_size) + 1)


def first_kept_token(sliding_window: int, num_computed_tokens: int) -> int:
    """The first token a sliding group must keep for a sequence with ``num_computed_tokens`` computed: its next
    query (at position ``num_computed_tokens``) reads the ``sliding_window`` tokens up to itself, and two tokens
    more are kept, since a query may go back a token (a beam that missed a step) and a fork re-decodes its parent's
    last prompt token while the parent may be a step ahead (async scheduling). Blocks wholly before it go back."""
    return max(0, num_computed_tokens - sliding_window - 1)


@functools.cache
def layout_for(sliding_layers: tuple[bool, ...], sliding_window: int | None, *, hybrid: bool = True) -> KVCacheLayout:
    """The groups of a model whose layers slide as ``sliding_layers`` says. Not ``hybrid`` (vLLM's
    `disable_hybrid_kv_cache_manager`): one group that keeps every token of every layer."""
    num_layers = len(sliding_layers)
    if not hybrid or sliding_window is None or not any(sliding_layers):
        return KVCacheLayout((KVCacheGroup(tuple(range(num_layers))),))
    full = tuple(layer for layer, slides in enumerate(sliding_layers) if not slides)
    sliding = tuple(layer for layer, slides in enumerate(sliding_layers) if slides)
    size = min(len(full), len(sliding)) or num_layers
    chunks = lambda layers: [layers[i : i + size] for i in range(0, len(layers), size)]
    groups = [KVCacheGroup(layers) for layers in chunks(full)]
    groups += [KVCacheGroup(layers, sliding_window) for layers in chunks(sliding)]
    return KVCacheLayout(tuple(groups))


NULL_BLOCK = -1  # a sliding group's table entry for a block given back (out of the window: never read unmasked)
