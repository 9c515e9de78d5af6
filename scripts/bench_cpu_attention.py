"""Paged attention on CPU: the native kernel (`kernels_cpu`, the "cpu" backend) against plain XLA (the
"reference" backend), one layer of the embedded model's KV pool, same inputs, same run: decode rows, then
prefill chunks (one row of `--chunks` query tokens after `--cached` tokens already in the cache).

Shapes are SmolLM2-135M's: 9 query heads over 3 KV heads of 64, block size 16, a 30-layer pool of 4096
blocks (twice the engine's CPU default, so that 64 rows of 1024 tokens fit), pages shuffled. Each row of
the table is a batch of decode rows at one context length (or the
"mixed" batch: lengths uniform in 100..1300, the spread of shared/workloads/mixed_lengths.jsonl); it
prints the median milliseconds per layer of each backend, the ratio, and the K/V bytes each row reads
divided by the kernel's time. ``--dtype bfloat16`` stores the pool in bfloat16 (the math stays float32).

    python scripts/bench_cpu_attention.py
    python scripts/bench_cpu_attention.py --batches 1 16 64 --contexts 256 1024 --iters 20 --dtype bfloat16
    python scripts/bench_cpu_attention.py --chunks 128 512 --cached 0 1024
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_kernels import time_call  # noqa: E402

from jaxserve.attention.backends import CpuBackend, ReferenceBackend  # noqa: E402
from jaxserve.attention.metadata import AttentionMetadata  # noqa: E402
from jaxserve.math_utils import cdiv  # noqa: E402

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK, BLOCKS = 30, 3, 9, 64, 16, 4096
LAYER = 7


def make_batch(rng, lengths: np.ndarray) -> AttentionMetadata:
    pages_per_seq = cdiv(int(lengths.max()), BLOCK)
    needed = cdiv(lengths, BLOCK)
    if needed.sum() > BLOCKS:
        raise SystemExit(f"{needed.sum()} pages do not fit the {BLOCKS}-block pool: use smaller batches or contexts")
    pages = rng.permutation(BLOCKS)
    tables = np.zeros((len(lengths), pages_per_seq), np.int32)
    offset = 0
    for row, count in enumerate(needed):
        tables[row, :count] = pages[offset : offset + count]
        offset += count
    lengths = lengths.astype(np.int32)
    return AttentionMetadata(jnp.asarray(tables), jnp.asarray(lengths - 1), jnp.asarray(lengths))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--chunks", type=int, nargs="+", default=[128, 512], help="prefill chunk lengths")
    parser.add_argument("--cached", type=int, nargs="+", default=[0, 1024], help="tokens cached before a chunk")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the KV pool's dtype")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    shape = (LAYERS, KV_HEADS, BLOCKS, BLOCK, HEAD_DIM)
    k_pool = jnp.asarray(rng.standard_normal(shape, np.float32), args.dtype)
    v_pool = jnp.asarray(rng.standard_normal(shape, np.float32), args.dtype)
    backends = {"reference": ReferenceBackend(), "cpu": CpuBackend()}
    steps = {
        name: jax.jit(lambda q, k, v, meta, b=backend: b.attend(q, k, v, jnp.int32(LAYER), meta, sm_scale=0.125))
        for name, backend in backends.items()
    }
    cases = [(b, f"{c}", np.full(b, c)) for b in args.batches for c in args.contexts]
    cases += [(64, "mixed 100..1300", np.sort(rng.integers(100, 1300, 64))[::-1])]
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.dtype} pool, median of {args.iters} per layer")
    print("| decode rows | context | plain XLA ms | native kernel ms | speed-up | kernel K/V GB/s |")
    print("|---|---|---|---|---|---|")
    for batch, label, lengths in cases:
        meta = make_batch(rng, lengths)
        q = jnp.asarray(rng.standard_normal((batch, 1, Q_HEADS, HEAD_DIM), np.float32))
        xla, native = compare(steps, q, k_pool, v_pool, meta, args.iters)
        kv_bytes = 2 * int(lengths.sum()) * KV_HEADS * HEAD_DIM * k_pool.dtype.itemsize
        print(f"| {batch} | {label} | {xla:.2f} | {native:.2f} | {xla / native:.2f}x | {kv_bytes / native / 1e6:.1f} |")
    print()
    print("| prefill chunk | cached before | plain XLA ms | native kernel ms | speed-up |")
    print("|---|---|---|---|---|")
    for chunk in args.chunks:
        for cached in args.cached:
            meta = make_batch(rng, np.array([cached + chunk])).replace(q_start=jnp.array([cached], jnp.int32))
            q = jnp.asarray(rng.standard_normal((1, chunk, Q_HEADS, HEAD_DIM), np.float32))
            xla, native = compare(steps, q, k_pool, v_pool, meta, args.iters)
            print(f"| {chunk} | {cached} | {xla:.2f} | {native:.2f} | {xla / native:.2f}x |")


def compare(steps, q, k_pool, v_pool, meta, iters: int) -> tuple[float, float]:
    """Milliseconds of the plain-XLA and the native step on the same inputs, after checking they agree."""
    outs = {name: step(q, k_pool, v_pool, meta) for name, step in steps.items()}
    np.testing.assert_allclose(outs["cpu"], outs["reference"], rtol=1e-4, atol=1e-5)
    return tuple(1e3 * time_call(steps[name], q, k_pool, v_pool, meta, iters=iters) for name in ("reference", "cpu"))

if __name__ == "__main__":
    main()
