"""Compile the Pallas attention kernels alone for TPU topologies on this host and show what the pool layout
costs: bytes accessed, temporaries and whole-pool copies, plain `[.., page_size, head_dim]` pages against
the lane-dense `[.., page_size * head_dim / 128, 128]` layout the engine uses on TPU when head_dim < 128.

The issue's case: decode attention, batch 8, 9 query / 3 KV heads, 2048 pages of 16 x 64 (K and V of one
layer, 50 MB in float32). XLA's default TPU layout of a pool whose last dimension is 64 puts the pages
dimension minor (`{1,3,2,0}`), and a Mosaic kernel reads row-major tiles only, so every call first
relays out (copies) the whole pool; the lane-dense layout is row-major by default and is read in place.

    python scripts/tpu_kernel_layouts.py                    # v5e:2x2 and v6e:2x2, float32 and bfloat16

With --int8, the three kernels (decode, prefill, ragged) over the int8 KV cache instead: an int8 stacked pool
with its float32 scales per token and kv head, bfloat16 queries, head_dim 128 (plain layout) and 64
(lane-dense), compiled by Mosaic for each topology; the table counts copies of the whole pool and of the
whole scale arrays (XLA stores `[.., pages, page_size]` scales pages-minor: the kernels gather what they need
instead of reading them in place, so there must be none).

    python scripts/tpu_kernel_layouts.py --int8 --topologies v5e:2x2
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxserve  # noqa: E402, F401  (quiets libtpu on a host without a TPU)
import kernels_pallas  # noqa: E402

NUM_KV_HEADS, NUM_PAGES, PAGE_SIZE, HEAD_DIM, BATCH, NUM_Q_HEADS = 3, 2048, 16, 64, 8, 9
LANES = 128


def compile_decode(topology: str, dtype, num_layers: int, lane_dense: bool):
    """The compiled decode kernel over a stacked pool of ``num_layers`` (1: the issue's one-layer pool)."""
    device = topologies.get_topology_desc(topology, "tpu").devices[0]
    rep = NamedSharding(Mesh(np.array([device]), ("x",)), P())
    page = (PAGE_SIZE // 2, 2 * HEAD_DIM) if lane_dense else (PAGE_SIZE, HEAD_DIM)
    pool = jax.ShapeDtypeStruct((num_layers, NUM_KV_HEADS, NUM_PAGES, *page), dtype, sharding=rep)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)
    q = jax.ShapeDtypeStruct((BATCH, NUM_Q_HEADS, HEAD_DIM), dtype, sharding=rep)

    def decode(q, k, v, lengths, tables, layer):
        return kernels_pallas.paged_attention(q, k, v, lengths, tables, layer=layer, backend="tpu")

    return jax.jit(decode).lower(q, pool, pool, i32(BATCH), i32(BATCH, 128), i32()).compile()


def compile_int8(topology: str, kernel: str, num_layers: int, head_dim: int):
    """The compiled ``kernel`` ("decode", "prefill" or "ragged") over an int8 stacked pool of ``num_layers`` and
    its scales, bfloat16 q, in the layout the engine uses for ``head_dim`` (lane-dense below 128)."""
    device = topologies.get_topology_desc(topology, "tpu").devices[0]
    rep = NamedSharding(Mesh(np.array([device]), ("x",)), P())
    tokens_per_row = LANES // head_dim if head_dim < LANES else 1
    page = (PAGE_SIZE // tokens_per_row, tokens_per_row * head_dim)
    pool = jax.ShapeDtypeStruct((num_layers, NUM_KV_HEADS, NUM_PAGES, *page), jnp.int8, sharding=rep)
    scales = jax.ShapeDtypeStruct((num_layers, NUM_KV_HEADS, NUM_PAGES, PAGE_SIZE), jnp.float32, sharding=rep)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=rep)
    kv = dict(backend="tpu", sm_scale=head_dim**-0.5)
    if kernel == "decode":
        q, rows = bf16(BATCH, NUM_Q_HEADS, head_dim), (i32(BATCH),)
        call = lambda q, k, v, ks, vs, table, layer, lengths: kernels_pallas.paged_attention(
            q, k, v, lengths, table, layer=layer, k_scales=ks, v_scales=vs, **kv)
    elif kernel == "prefill":
        q, rows = bf16(BATCH, 256, NUM_Q_HEADS, head_dim), (i32(BATCH), i32(BATCH))
        call = lambda q, k, v, ks, vs, table, layer, q_start, lengths: kernels_pallas.prefill_attention(
            q, k, v, table, q_start, lengths, layer=layer, k_scales=ks, v_scales=vs, **kv)
    else:
        q, rows = bf16(512, NUM_Q_HEADS, head_dim), (i32(BATCH),) * 4
        call = lambda q, k, v, ks, vs, table, layer, *rows: kernels_pallas.ragged_paged_attention(
            q, k, v, table, *rows, layer=layer, k_scales=ks, v_scales=vs, **kv)
    return jax.jit(call).lower(q, pool, pool, scales, scales, i32(BATCH, 128), i32(), *rows).compile()


def whole_copies(compiled, shape: tuple) -> int:
    """Instructions that produce an array of ``shape`` (a whole pool or scale array), parameters aside."""
    pattern = re.compile(rf"= \w+\[{','.join(map(str, shape))}\]\S* (copy|custom-call|fusion|transpose)\(")
    return sum(1 for line in compiled.as_text().splitlines() if pattern.search(line))


def main_int8(topology_names: list[str], num_layers: int) -> int:
    print("topology  kernel   head_dim  layout      bytes accessed MB  temp MB  pool copies  scale copies")
    for topology in topology_names:
        for kernel in ("decode", "prefill", "ragged"):
            for head_dim in (128, 64):
                compiled = compile_int8(topology, kernel, num_layers, head_dim)
                cost = compiled.cost_analysis()
                cost = cost if isinstance(cost, dict) else cost[0]
                tokens_per_row = LANES // head_dim if head_dim < LANES else 1
                pool = (num_layers, NUM_KV_HEADS, NUM_PAGES, PAGE_SIZE // tokens_per_row, tokens_per_row * head_dim)
                scales = (num_layers, NUM_KV_HEADS, NUM_PAGES, PAGE_SIZE)
                print(f"{topology:8}  {kernel:7}  {head_dim:8}  {'lane-dense' if tokens_per_row > 1 else 'plain':10}  "
                      f"{cost.get('bytes accessed', 0) / 1e6:17.1f}  "
                      f"{compiled.memory_analysis().temp_size_in_bytes / 1e6:7.1f}  "
                      f"{whole_copies(compiled, pool):11d}  {whole_copies(compiled, scales):12d}")
    return 0


def pool_bytes(num_layers: int, dtype) -> int:
    """K and V of the pool."""
    return 2 * num_layers * NUM_KV_HEADS * NUM_PAGES * PAGE_SIZE * HEAD_DIM * jnp.dtype(dtype).itemsize


def pool_copies(compiled) -> int:
    """Instructions that produce a whole pool-shaped array (copies and relayouts), parameters aside."""
    pattern = re.compile(rf"= \w+\[\d+,{NUM_KV_HEADS},{NUM_PAGES},\d+,\d+\]\S* (copy|custom-call|fusion)\(")
    return sum(1 for line in compiled.as_text().splitlines() if pattern.search(line))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topologies", default="v5e:2x2,v6e:2x2")
    parser.add_argument("--layers", type=int, default=1, help="layers of the stacked pool (the engine's: 30)")
    parser.add_argument("--int8", action="store_true", help="the three kernels over the int8 KV cache (see above)")
    args = parser.parse_args()
    if args.int8:
        return main_int8(args.topologies.split(","), args.layers)
    print("topology  dtype     layout      pool MB  bytes accessed MB  temp MB  pool copies")
    for topology in args.topologies.split(","):
        for dtype in (jnp.float32, jnp.bfloat16):
            for lane_dense in (False, True):
                compiled = compile_decode(topology, dtype, args.layers, lane_dense)
                cost = compiled.cost_analysis()
                cost = cost if isinstance(cost, dict) else cost[0]
                pool_mb = pool_bytes(args.layers, dtype) / 1e6
                print(f"{topology:8}  {jnp.dtype(dtype).name:8}  {'lane-dense' if lane_dense else 'plain':10}  "
                      f"{pool_mb:7.1f}  {cost.get('bytes accessed', 0) / 1e6:17.1f}  "
                      f"{compiled.memory_analysis().temp_size_in_bytes / 1e6:7.1f}  {pool_copies(compiled):11d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
