"""Compile the Pallas attention kernels alone for TPU topologies on this host and show what the pool layout
costs: bytes accessed, temporaries and whole-pool copies, plain `[.., page_size, head_dim]` pages against
the lane-dense `[.., page_size * head_dim / 128, 128]` layout the engine uses on TPU when head_dim < 128.

The issue's case: decode attention, batch 8, 9 query / 3 KV heads, 2048 pages of 16 x 64 (K and V of one
layer, 50 MB in float32). XLA's default TPU layout of a pool whose last dimension is 64 puts the pages
dimension minor (`{1,3,2,0}`), and a Mosaic kernel reads row-major tiles only, so every call first
relays out (copies) the whole pool; the lane-dense layout is row-major by default and is read in place.

    python scripts/tpu_kernel_layouts.py                    # v5e:2x2 and v6e:2x2, float32 and bfloat16
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
    args = parser.parse_args()
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
