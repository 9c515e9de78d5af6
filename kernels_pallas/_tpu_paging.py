"""Double-buffered streaming of K/V pages from HBM into VMEM for the TPU (Mosaic) kernels.

The TPU kernels read the stacked pool in HBM at the layer index they are given (scalar-prefetched), so
no layer's slice is ever copied out of it. Each walks one sequence's block table for one KV head in
blocks of ``pages_per_block`` pages from ``first_page`` on (0, or with a sliding window the page holding
the window's first key): while block ``i`` is being computed, the DMAs for block ``i + 1`` already run into
the other VMEM slot.
Only pages from ``first_page`` up to ``num_pages`` are copied; the rest of a slot keeps stale (or, in
interpret mode, NaN) data, which the kernels mask out.

An int8 pool's scales (``_common``: f32 ``[num_layers, num_kv_heads, total_pages, page_size]``) are not read
in place: XLA stores an f32 array whose last dimension is below 128 with the pages dimension minor (TPU
layout ``{2,3,1,0}``), where a page's scales are a column that a DMA cannot address, and a Mosaic operand
in the row-major layout would cost a relayout copy of every layer's scales on every call. So the wrapper
gathers the scales of the batch's block tables with XLA (``gather_token_scales``) into lane-dense rows, one
per (table row, kv head, token slice of a pool row), and the stream DMAs each compute block's window of
them with its pages (``ScaleRows``). XLA's gather reads the one layer's scales (num_kv_heads * total_pages
* page_size floats for K, as many for V: 4 / head_dim of the layer's int8 pages), relayouts them on chip and
writes 4 bytes per table slot; every call pays that, whatever the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import _common as cm


def scale_window(rows_per_block: int) -> int:
    """Lanes of the scale rows DMA'd per block: the block's rows rounded up to whole vregs, plus one vreg for
    the window's 128-aligned start (a DMA of HBM lanes starts at a multiple of 128)."""
    return pl.cdiv(rows_per_block, cm.LANES) * cm.LANES + cm.LANES


def gather_token_scales(scales: jax.Array, layer: jax.Array, tables: jax.Array, geometry: cm.PoolGeometry,
                        pages_per_block: int) -> jax.Array:
    """f32[num_rows * num_kv_heads * tokens_per_row, lanes]: the scales ``[num_layers, num_kv_heads,
    total_pages, page_size]`` at ``layer`` of the pages of each block-table row ``tables`` i32[num_rows,
    pages_per_seq] (entries clamped into the pool; the kernels zero scales past kv_end), one row per (table
    row, kv head, token slice of a pool row): lane j * rows_per_page + i of the row of slice ``part`` holds
    the scale of the table's page j, token i * tokens_per_row + part (the token of pool row i and that
    slice). Zeros past the table, far enough for the last block's window (``scale_window``)."""
    g = geometry
    num_rows, pages_per_seq = tables.shape
    pages = jnp.clip(tables, 0, g.total_pages - 1)
    x = jnp.take(jnp.swapaxes(scales[layer[0]], -1, -2), pages, axis=-1)  # [Hkv, page_size, rows, pages_per_seq]
    x = x.reshape(g.num_kv_heads, g.rows_per_page, g.tokens_per_row, num_rows, pages_per_seq)
    x = x.transpose(3, 0, 2, 4, 1).reshape(num_rows * g.num_kv_heads * g.tokens_per_row, -1)
    rows_per_block = pages_per_block * g.rows_per_page
    lanes = pl.cdiv((pages_per_seq + pages_per_block) * g.rows_per_page, cm.LANES) * cm.LANES
    return jnp.pad(x, ((0, 0), (0, lanes + scale_window(rows_per_block) - x.shape[1])))


@dataclasses.dataclass(frozen=True)
class ScaleRows:
    """The int8 pool's token scales for one grid point: its rows of ``gather_token_scales``, a window per
    block DMA'd with the block's pages."""

    k_hbm: object  # ref f32[num_rows * num_kv_heads * tokens_per_row, lanes], HBM: gather_token_scales
    v_hbm: object  # ref like k_hbm
    buf: object  # ref f32[2 (k, v), 2 (slot), tokens_per_row, 1, window], VMEM
    sems: object  # DMA semaphores [2 (k, v), 2 (slot)]
    first_row: jax.Array  # i32 scalar: the row of token slice 0 of this (table row, kv head)

    def _offset(self, first_page_of_block, rows_per_page: int):
        """(128-aligned first lane of the DMA window, the block's first lane within the window)."""
        start = first_page_of_block * rows_per_page
        base = pl.multiple_of(lax.div(start, cm.LANES) * cm.LANES, cm.LANES)
        return base, start - base

    def copies(self, first_page_of_block, rows_per_page: int, slot):
        base, _ = self._offset(first_page_of_block, rows_per_page)
        window = self.buf.shape[-1]
        for which, hbm in enumerate((self.k_hbm, self.v_hbm)):
            for part in range(self.buf.shape[2]):
                yield pltpu.make_async_copy(
                    hbm.at[pl.ds(self.first_row + part, 1), pl.ds(base, window)],
                    self.buf.at[which, slot, part],
                    self.sems.at[which, slot],
                )

    def read(self, first_page_of_block, rows_per_page: int, rows_per_block: int, slot):
        """(k_scales, v_scales), each a list over token slices of f32[1, rows_per_block]: the block's scales
        as ``_common.causal_block_step`` takes them."""
        _, shift = self._offset(first_page_of_block, rows_per_page)
        window = self.buf.shape[-1]
        return tuple(
            [
                pltpu.roll(self.buf[which, slot, part], lax.rem(window - shift, window), 1)[:, :rows_per_block]
                for part in range(self.buf.shape[2])
            ]
            for which in range(2)
        )


@dataclasses.dataclass(frozen=True)
class PageStream:
    """K/V page copies for one (sequence, kv head) grid point (and an int8 pool's scales: ``scales``)."""

    k_hbm: object  # ref [num_layers, num_kv_heads, total_pages, rows, lanes], HBM (pl.ANY): the stacked pool
    v_hbm: object  # ref [num_layers, num_kv_heads, total_pages, rows, lanes], HBM (pl.ANY); None: keys only (MLA)
    k_buf: object  # ref [2, pages_per_block, rows, lanes], VMEM (two slots)
    v_buf: object  # ref [2, pages_per_block, rows, lanes], VMEM (two slots); None with v_hbm
    sems: object  # DMA semaphores [2 (k, v), 2 (slot)]
    table_ref: object  # SMEM i32[num_seqs * pages_per_seq], flattened block table
    table_offset: jax.Array  # i32 scalar, seq * pages_per_seq
    layer: jax.Array  # i32 scalar, the layer whose pages are read
    head: jax.Array  # i32 scalar, kv head
    num_pages: jax.Array  # i32 scalar, pages that hold tokens we need (the end of the walk)
    first_page: jax.Array | int = 0  # i32 scalar, the first page to copy (pages before a sliding window: skipped)
    scales: ScaleRows | None = None  # an int8 pool's scales

    @property
    def pages_per_block(self) -> int:
        return self.k_buf.shape[1]

    @property
    def rows_per_page(self) -> int:
        return self.k_buf.shape[2]

    def _first_page_of(self, block):
        return cm.plus(block * self.pages_per_block, self.first_page)

    def _for_each_copy(self, block, slot, action) -> None:
        if self.scales is not None:
            for copy in self.scales.copies(self._first_page_of(block), self.rows_per_page, slot):
                action(copy)
        for p in range(self.pages_per_block):
            page_no = cm.plus(block * self.pages_per_block + p, self.first_page)

            @pl.when(page_no < self.num_pages)
            def _(p=p, page_no=page_no):
                page = self.table_ref[self.table_offset + page_no]
                for which, (hbm, buf) in enumerate(self._pools()):
                    copy = pltpu.make_async_copy(
                        hbm.at[self.layer, self.head, page], buf.at[slot, p], self.sems.at[which, slot]
                    )
                    action(copy)

    def _pools(self):
        """(HBM ref, VMEM slots) of K and of V (only K for a keys-only pool)."""
        pools = [(self.k_hbm, self.k_buf), (self.v_hbm, self.v_buf)]
        return pools[:1] if self.v_hbm is None else pools

    def start(self, block, slot) -> None:
        self._for_each_copy(block, slot, lambda copy: copy.start())

    def wait(self, block, slot) -> None:
        self._for_each_copy(block, slot, lambda copy: copy.wait())

    def block_scales(self, block, slot):
        """The int8 pool's scales of a block whose copies are done (``ScaleRows.read``); None for other pools."""
        if self.scales is None:
            return None
        rows = self.pages_per_block * self.rows_per_page
        return self.scales.read(self._first_page_of(block), self.rows_per_page, rows, slot)


def open_stream(refs, *, quantized: bool, table_ref, table_row, pages_per_seq: int, layer, head, num_pages,
                first_page=0):
    """(PageStream, o_ref) from a TPU kernel's refs after q's: the pool's HBM refs (k, v, and with an int8
    pool (``quantized``) its gathered scales'), the output's, then the scratch of ``stream_operands``."""
    k_hbm, v_hbm, *refs = refs
    (k_scales, v_scales), (o_ref, k_buf, v_buf, sems, *scale_scratch) = cm.split_scale_refs(refs, quantized)
    scales = None
    if quantized:
        tokens_per_row = scale_scratch[0].shape[2]
        first_row = (table_row * k_hbm.shape[1] + head) * tokens_per_row
        scales = ScaleRows(k_scales, v_scales, *scale_scratch, first_row=first_row)
    stream = PageStream(
        k_hbm, v_hbm, k_buf, v_buf, sems, table_ref, table_offset=table_row * pages_per_seq, layer=layer,
        head=head, num_pages=num_pages, first_page=first_page, scales=scales,
    )
    return stream, o_ref


def stream_operands(k_pool, v_pool, k_scales, v_scales, layer, tables, geometry: cm.PoolGeometry,
                    pages_per_block: int):
    """(in_specs, arrays, scratch_shapes) of a TPU kernel's pool: the stacked pools in HBM, with an int8 pool
    its scales gathered for the block-table rows ``tables`` (``gather_token_scales``), and the stream's VMEM
    slots and semaphores (``open_stream`` takes them apart in the kernel)."""
    g = geometry
    arrays = [k_pool, v_pool]
    buf = pltpu.VMEM((2, pages_per_block, g.rows_per_page, g.lanes), k_pool.dtype)
    scratch = [buf, buf, pltpu.SemaphoreType.DMA((2, 2))]
    if k_scales is not None:
        arrays += [gather_token_scales(x, layer, tables, g, pages_per_block) for x in (k_scales, v_scales)]
        window = scale_window(pages_per_block * g.rows_per_page)
        scratch += [pltpu.VMEM((2, 2, g.tokens_per_row, 1, window), jnp.float32), pltpu.SemaphoreType.DMA((2, 2))]
    return [pl.BlockSpec(memory_space=pl.ANY)] * len(arrays), arrays, scratch


def fold_pages(stream: PageStream, num_blocks: jax.Array, body, init):
    """Runs ``body(block, k, v, scales, carry)`` over blocks ``0..num_blocks-1`` with double-buffered DMAs
    (block ``i`` holds pages ``stream.first_page + i * pages_per_block`` onwards).

    k, v: [pages_per_block * rows, lanes] pool rows of the block (``PoolGeometry``; tokens past the copied
    pages are garbage and must be masked by ``body``; v None for a keys-only stream); scales: an int8 pool's
    (``PageStream.block_scales``), else None. Returns the final carry.
    """

    @pl.when(num_blocks > 0)
    def _():
        stream.start(0, 0)

    def step(block, carry):
        slot = lax.rem(block, 2)

        @pl.when(block + 1 < num_blocks)
        def _():
            stream.start(block + 1, 1 - slot)

        stream.wait(block, slot)
        _, pages, rows, lanes = stream.k_buf.shape
        k = stream.k_buf[slot].reshape(pages * rows, lanes)
        v = None if stream.v_buf is None else stream.v_buf[slot].reshape(pages * rows, lanes)
        return body(block, k, v, stream.block_scales(block, slot), carry)

    return lax.fori_loop(0, num_blocks, step, init)
