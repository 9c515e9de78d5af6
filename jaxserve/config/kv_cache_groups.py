"""KV cache groups: which layers share a block table, and how many blocks a request holds (no JAX).

vLLM V1's hybrid layout. Layers are grouped by what their cache keeps: full-attention layers every token,
sliding-window layers only the tokens their window still reaches. All groups have the same number of layers
(``layers_per_group``: the fewest layers of one kind, vLLM's rule), so a block of the pool is the same size in
every group and one free list serves them all: the pool is ``[layers_per_group, Hkv, num_blocks, ...]``, and a
block id belongs to one group at a time. Layer ``l`` reads and writes pool row ``slot_of[l]`` through the block
table of group ``group_of[l]``; a group shorter than the others leaves its last rows unused.

Gemma 4's layers differ in page shape (its full layers' head_dim and kv heads are not its sliding layers'): the
pool is then one array per shape ("kind", `ModelConfig.kv_page_shapes`), each ``[layers_per_group, Hkv_k,
num_blocks, ...]``, and a group holds layers of one kind. A block id has a page in every kind's array (one free
list), so a block of one kind's group leaves the other kinds' page of that id unused. Its KV-sharing layers keep
no cache: they read the layer they share with (``readers``).

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
    """``layer_kinds``: per model layer, its page shape's index (`ModelConfig.kv_page_shapes`; empty: every layer
    kind 0); the pool is one array per kind. ``readers``: (layer, source) pairs, layers that keep no cache and read
    their source layer's (Gemma 4's KV sharing), in no group."""

    groups: tuple[KVCacheGroup, ...]
    layer_kinds: tuple[int, ...] = ()
    readers: tuple[tuple[int, int], ...] = ()

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_kinds(self) -> int:
        return max(self.layer_kinds, default=0) + 1

    @property
    def layers_per_group(self) -> int:
        """Rows of each kind's pool: the most layers of one kind in one group."""
        return max(self._rows_of_kind(group, kind) for group in self.groups for kind in range(self.num_kinds))

    def kind_of(self, layer: int) -> int:
        """The page shape (pool) of ``layer``'s cache."""
        return self.layer_kinds[self.source_of(layer)] if self.layer_kinds else 0

    def source_of(self, layer: int) -> int:
        """The layer whose cache ``layer`` reads: itself, or for a reader its source."""
        return dict(self.readers).get(layer, layer)

    def _rows_of_kind(self, group: KVCacheGroup, kind: int) -> int:
        return sum(self.kind_of(layer) == kind for layer in group.layers)

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
        """Per model layer, ``value(group, row)`` of its cache: its row is its index among its group's layers of its
        kind; a reader gets its source's."""
        place = {}
        for g, group in enumerate(self.groups):
            rows = [0] * self.num_kinds
            for layer in group.layers:
                place[layer] = value(g, rows[self.kind_of(layer)])
                rows[self.kind_of(layer)] += 1
        place.update({reader: place[source] for reader, source in self.readers})
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
def layout_for(sliding_layers: tuple[bool, ...], sliding_window: int | None, *, hybrid: bool = True,
               layer_kinds: tuple[int, ...] = (), readers: tuple[tuple[int, int], ...] = ()) -> KVCacheLayout:
    """The groups of a model whose layers slide as ``sliding_layers`` says, with pages of the shapes
    ``layer_kinds`` gives (empty: one shape), ``readers`` keeping no cache of their own (`KVCacheLayout`). Layers of
    one window and one kind form groups; every group has as many layers as the fewest of one (window, kind). Not
    ``hybrid`` (vLLM's `disable_hybrid_kv_cache_manager`): one group that keeps every token of every layer."""
    reading = {reader for reader, _ in readers}
    owners = tuple(layer for layer in range(len(sliding_layers)) if layer not in reading)
    if not hybrid or sliding_window is None or not any(sliding_layers[layer] for layer in owners):
        return KVCacheLayout((KVCacheGroup(owners),), layer_kinds, readers)
    kind = lambda layer: layer_kinds[layer] if layer_kinds else 0
    kinds_of_layers: dict[tuple[bool, int], list[int]] = {}
    for layer in owners:
        kinds_of_layers.setdefault((sliding_layers[layer], kind(layer)), []).append(layer)
    size = min(len(layers) for layers in kinds_of_layers.values())
    groups = [KVCacheGroup(tuple(layers[i : i + size]), sliding_window if slides else None)
              for (slides, _), layers in sorted(kinds_of_layers.items()) for i in range(0, len(layers), size)]
    return KVCacheLayout(tuple(groups), layer_kinds, readers)


NULL_BLOCK = -1  # a sliding group's table entry for a block given back (out of the window: never read unmasked)
