"""KV cache groups: which layers share a block table, and how many blocks a request holds (no JAX).

vLLM V1's hybrid layout. Layers are grouped by what their cache keeps: full-attention layers every token,
sliding-window layers only the tokens their window still reaches. All groups have the same number of layers
(``layers_per_group``: the fewest layers of one kind, vLLM's rule), so a block of the pool is the same size in
every group and one free list serves them all: the pool is ``[layers_per_group, Hkv, num_blocks, ...]``, and a
block id belongs to one group at a time. Layer ``l`` reads and writes pool row ``slot_of[l]`` through the block
table of group ``group_of[l]``; a group shorter than the others leaves its last rows unused.

Gemma 4's layers differ in page shape (its full layers' head_dim and kv heads are not its sliding layers'): the
pool is then one array per shape ("kind", `ModelConfig.kv_page_shapes`), each ``[rows_of_kind(k), Hkv_k,
blocks_k, ...]``, and a group holds layers of one kind (without the hybrid layout too: a full group per kind). The
block ids are shared out among the kinds (`blocks_of_kinds`: the blocks a step's chunks hold in the sliding groups,
the rest in proportion to what a request of max_model_len tokens holds in each), each kind with its own free list;
kind k's ids follow kind k - 1's, and a step reads its groups' tables less their kind's first id. Its KV-sharing
layers keep no cache: they read the layer they share with (``readers``).

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
        """Rows of the pool: the most layers of one group."""
        return max(len(group.layers) for group in self.groups)

    def rows_of_kind(self, kind: int) -> int:
        """Rows of one kind's pool: the most layers of one of its groups."""
        return max(len(group.layers) for group, k in zip(self.groups, self.group_kinds, strict=True) if k == kind)

    def kind_of(self, layer: int) -> int:
        """The page shape (pool) of ``layer``'s cache."""
        return self.layer_kinds[self.source_of(layer)] if self.layer_kinds else 0

    def source_of(self, layer: int) -> int:
        """The layer whose cache ``layer`` reads: itself, or for a reader its source."""
        return dict(self.readers).get(layer, layer)

    @property
    def group_kinds(self) -> tuple[int, ...]:
        """Per group: the kind of its layers (a group holds one kind)."""
        return tuple(self.kind_of(group.layers[0]) for group in self.groups)

    def kind_demand(self, num_tokens: int, block_size: int, max_chunk_tokens: int = 0) -> tuple[int, ...]:
        """Per kind: the blocks one request of ``num_tokens`` tokens holds at once in that kind's groups."""
        demand = [0] * self.num_kinds
        for group, kind in zip(self.groups, self.group_kinds, strict=True):
            demand[kind] += blocks_per_request(group.sliding_window, num_tokens, block_size, max_chunk_tokens)
        return tuple(demand)

    def in_flight_blocks(self, block_size: int, max_chunk_tokens: int) -> tuple[int, ...]:
        """Per kind: the blocks a step's prompt chunks (``max_chunk_tokens`` over all its rows) hold in its sliding
        groups beyond what the requests keep (once per step, not per request)."""
        flight = [0] * self.num_kinds
        for window, kind in zip(self.windows, self.group_kinds, strict=True):
            flight[kind] += 0 if window is None else cdiv(max_chunk_tokens, block_size) + 1
        return tuple(flight)

    def blocks_of_kinds(self, num_blocks: int, max_model_len: int, block_size: int,
                        max_chunk_tokens: int = 0) -> tuple[int, ...]:
        """``num_blocks`` shared out among the kinds' pools so that they hold the most requests of ``max_model_len``
        tokens at once (`max_concurrency`): each kind its blocks in flight, the rest in proportion to what a request
        holds in each (each kind at least one block). One kind: all of them."""
        if self.num_kinds == 1:
            return (num_blocks,)
        demand, flight = self.kind_demand(max_model_len, block_size), self.in_flight_blocks(block_size,
                                                                                           max_chunk_tokens)
        rest = num_blocks - sum(flight)
        if rest < sum(demand):  # not even one request beside the chunks: in proportion to the requests alone
            flight, rest = (0,) * self.num_kinds, num_blocks
        shares = [held + max(1, rest * need // sum(demand)) for held, need in zip(flight, demand, strict=True)]
        shares[shares.index(max(shares))] += num_blocks - sum(shares)
        return tuple(shares)

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
        """Per model layer, ``value(group, row)`` of its cache; a reader gets its source's."""
        place = {layer: value(g, slot)
                 for g, group in enumerate(self.groups) for slot, layer in enumerate(group.layers)}
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
        all its rows) hold more of each sliding group once, not per request. With pages of several kinds, the
        fewest any kind's pool holds (`blocks_of_kinds`)."""
        per_request = self.kind_demand(num_tokens, block_size)
        in_flight = self.in_flight_blocks(block_size, max_chunk_tokens)
        pools = self.blocks_of_kinds(num_blocks, num_tokens, block_size, max_chunk_tokens)
        return min(max(0, blocks - flight) / need for blocks, flight, need
                   in zip(pools, in_flight, per_request, strict=True))

    def fits_one_request(self, num_blocks: int, num_tokens: int, block_size: int, max_chunk_tokens: int,
                         max_model_len: int) -> bool:
        """Whether every kind's pool (of a pool of ``num_blocks`` shared out for ``max_model_len``) holds one request
        of ``num_tokens`` tokens computed in chunks of ``max_chunk_tokens``."""
        pools = self.blocks_of_kinds(num_blocks, max_model_len, block_size, max_chunk_tokens)
        need = self.kind_demand(num_tokens, block_size, max_chunk_tokens)
        return all(blocks >= needed for blocks, needed in zip(pools, need, strict=True))


def first_block_ids(kind_blocks: tuple[int, ...]) -> tuple[int, ...]:
    """Each kind's first block id: kind k's ids follow kind k - 1's (`KVCacheLayout.blocks_of_kinds`)."""
    firsts, total = [], 0
    for count in kind_blocks:
        firsts.append(total)
        total += count
    return tuple(firsts)


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
    kind = lambda layer: layer_kinds[layer] if layer_kinds else 0
    if not hybrid or sliding_window is None or not any(sliding_layers[layer] for layer in owners):
        by_kind = {}  # one full-attention group per kind
        for layer in owners:
            by_kind.setdefault(kind(layer), []).append(layer)
        return KVCacheLayout(tuple(KVCacheGroup(tuple(by_kind[k])) for k in sorted(by_kind)), layer_kinds, readers)
    kinds_of_layers: dict[tuple[bool, int], list[int]] = {}
    for layer in owners:
        kinds_of_layers.setdefault((sliding_layers[layer], kind(layer)), []).append(layer)
    size = min(len(layers) for layers in kinds_of_layers.values())
    groups = [KVCacheGroup(tuple(layers[i : i + size]), sliding_window if slides else None)
              for (slides, _), layers in sorted(kinds_of_layers.items()) for i in range(0, len(layers), size)]
    return KVCacheLayout(tuple(groups), layer_kinds, readers)


NULL_BLOCK = -1  # a sliding group's table entry for a block given back (out of the window: never read unmasked)
