"""Double-buffered streaming of K/V pages from HBM into VMEM for the TPU (Mosaic) kernels.

The TPU kernels read the stacked pool in HBM at the layer index they are given (scalar-prefetched), so
no layer's slice is ever copied out of it. Each walks one sequence's block table for one KV head in
blocks of ``pages_per_block`` pages from ``first_page`` on (0, or with a sliding window the page holding
the window's first key): while block ``i`` is being computed, the DMAs for block ``i + 1`` already run into
the other VMEM slot.
Only pages from ``first_page`` up to ``num_pages`` are copied; the rest of a slot keeps stale (or, in
interpret mode, NaN) data, which the kernels mask out.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import _common as cm


@dataclasses.dataclass(frozen=True)
class PageStream:
    """K/V page copies for one (sequence, kv head) grid point."""

    k_hbm: object  # ref [num_layers, num_kv_heads, total_pages, rows, lanes], HBM (pl.ANY): the stacked pool
    v_hbm: object  # ref [num_layers, num_kv_heads, total_pages, rows, lanes], HBM (pl.ANY)
    k_buf: object  # ref [2, pages_per_block, rows, lanes], VMEM (two slots)
    v_buf: object  # ref [2, pages_per_block, rows, lanes], VMEM (two slots)
    sems: object  # DMA semaphores [2 (k, v), 2 (slot)]
    table_ref: object  # SMEM i32[num_seqs * pages_per_seq], flattened block table
    table_offset: jax.Array  # i32 scalar, seq * pages_per_seq
    layer: jax.Array  # i32 scalar, the layer whose pages are read
    head: jax.Array  # i32 scalar, kv head
    num_pages: jax.Array  # i32 scalar, pages that hold tokens we need (the end of the walk)
    first_page: jax.Array | int = 0  # i32 scalar, the first page to copy (pages before a sliding window: skipped)

    @property
    def pages_per_block(self) -> int:
        return self.k_buf.shape[1]

    def _for_each_page(self, block, slot, action) -> None:
        for p in range(self.pages_per_block):
            page_no = cm.plus(block * self.pages_per_block + p, self.first_page)

            @pl.when(page_no < self.num_pages)
            def _(p=p, page_no=page_no):
                page = self.table_ref[self.table_offset + page_no]
                for which, (hbm, buf) in enumerate(((self.k_hbm, self.k_buf), (self.v_hbm, self.v_buf))):
                    copy = pltpu.make_async_copy(
                        hbm.at[self.layer, self.head, page], buf.at[slot, p], self.sems.at[which, slot]
                    )
                    action(copy)

    def start(self, block, slot) -> None:
        self._for_each_page(block, slot, lambda copy: copy.start())

    def wait(self, block, slot) -> None:
        self._for_each_page(block, slot, lambda copy: copy.wait())


def fold_pages(stream: PageStream, num_blocks: jax.Array, body, init):
    """Runs ``body(block, k, v, carry)`` over blocks ``0..num_blocks-1`` with double-buffered DMAs (block
    ``i`` holds pages ``stream.first_page + i * pages_per_block`` onwards).

    k, v: [pages_per_block * rows, lanes] pool rows of the block (``PoolGeometry``; tokens past the copied
    pages are garbage and must be masked by ``body``). Returns the final carry.
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
        v = stream.v_buf[slot].reshape(pages * rows, lanes)
        return body(block, k, v, carry)

    return lax.fori_loop(0, num_blocks, step, init)
