"""Paged attention on CPU: the native kernel (`kernels_cpu`, the "cpu" backend) against plain XLA (the
"reference" backend), one layer of the embedded model's KV pool, same inputs, same run: decode rows, then
prefill chunks (one row of `--chunks` query tokens after `--cached` tokens already in the cache).

Shapes are SmolLM2-135M's: 9 query heads over 3 KV heads of 64, block size 16, a 30-layer pool of 4096
blocks (twice the engine's CPU default, so that 64 rows of 1024 tokens fit), pages shuffled. Each row of
the table is a batch of decode rows at one context length (or the
"mixed" batch: lengths uniform in 100..1300, the spread of shared/workloads/mixed_lengths.jsonl); it
prints the median milliseconds per layer of each backend, the ratio, and the K/V bytes each row reads
divided by the kernel's time. ``--dtype bfloat16`` stores the pool in bfloat16 (the math stays float32).

``--pools`` times the native kernel alone instead, on the same cases, once per pool storage: float32, uint16
(bfloat16 bits, the engine's CPU storage) and int8 (with a float32 scale per token and kv head, the int8 KV
cache), the calls of each case interleaved so that a change of load on the machine hits every storage alike.

    python scripts/bench_cpu_attention.py
    python scripts/bench_cpu_attention.py --batches 1 16 64 --contexts 256 1024 --iters 20 --dtype bfloat16
    python scripts/bench_cpu_attention.py --chunks 128 512 --cached 0 1024
    python scripts/bench_cpu_attention.py --pools uint16 int8
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_kernels import time_call  # noqa: E402

import kernels_cpu  # noqa: E402
from jaxserve.attention.backends import CpuBackend, ReferenceBackend  # noqa: E402
from jaxserve.attention.metadata import AttentionMetadata  # noqa: E402
from jaxserve.math_utils import cdiv  # noqa: E402

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK, BLOCKS = 30, 3, 9, 64, 16, 4096
LAYER = 7
POOL_SHAPE = (LAYERS, KV_HEADS, BLOCKS, BLOCK, HEAD_DIM)
POOL_STORAGES = ("float32", "uint16", "int8")


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


def decode_cases(rng, args):
    """(rows, context label, meta, q) of each batch of decode rows."""
    cases = [(b, f"{c}", np.full(b, c)) for b in args.batches for c in args.contexts]
    cases += [(64, "mixed 100..1300", np.sort(rng.integers(100, 1300, 64))[::-1])]
    for batch, label, lengths in cases:
        meta = make_batch(rng, lengths)
        yield batch, label, meta, jnp.asarray(rng.standard_normal((batch, 1, Q_HEADS, HEAD_DIM), np.float32))


def prefill_cases(rng, args):
    """(chunk, tokens cached before it, meta, q) of each prefill chunk."""
    for chunk in args.chunks:
        for cached in args.cached:
            meta = make_batch(rng, np.array([cached + chunk])).replace(q_start=jnp.array([cached], jnp.int32))
            yield chunk, cached, meta, jnp.asarray(rng.standard_normal((1, chunk, Q_HEADS, HEAD_DIM), np.float32))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--chunks", type=int, nargs="+", default=[128, 512], help="prefill chunk lengths")
    parser.add_argument("--cached", type=int, nargs="+", default=[0, 1024], help="tokens cached before a chunk")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the KV pool's dtype")
    parser.add_argument("--pools", nargs="+", choices=POOL_STORAGES,
                        help="time the native kernel alone on each of these pool storages instead")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    if args.pools:
        compare_pools(rng, args)
    else:
        compare_backends(rng, args)


def compare_backends(rng, args) -> None:
    k_pool = jnp.asarray(rng.standard_normal(POOL_SHAPE, np.float32), args.dtype)
    v_pool = jnp.asarray(rng.standard_normal(POOL_SHAPE, np.float32), args.dtype)
    backends = {"reference": ReferenceBackend(), "cpu": CpuBackend()}
    steps = {
        name: jax.jit(lambda q, k, v, meta, b=backend: b.attend(q, k, v, jnp.int32(LAYER), meta, sm_scale=0.125))
        for name, backend in backends.items()
    }
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.dtype} pool, median of {args.iters} per layer")
    print("| decode rows | context | plain XLA ms | native kernel ms | speed-up | kernel K/V GB/s |")
    print("|---|---|---|---|---|---|")
    for batch, label, meta, q in decode_cases(rng, args):
        xla, native = compare(steps, q, k_pool, v_pool, meta, args.iters)
        kv_bytes = 2 * int(meta.lengths.sum()) * KV_HEADS * HEAD_DIM * k_pool.dtype.itemsize
        print(f"| {batch} | {label} | {xla:.2f} | {native:.2f} | {xla / native:.2f}x | {kv_bytes / native / 1e6:.1f} |")
    print()
    print("| prefill chunk | cached before | plain XLA ms | native kernel ms | speed-up |")
    print("|---|---|---|---|---|")
    for chunk, cached, meta, q in prefill_cases(rng, args):
        xla, native = compare(steps, q, k_pool, v_pool, meta, args.iters)
        print(f"| {chunk} | {cached} | {xla:.2f} | {native:.2f} | {xla / native:.2f}x |")


def compare(steps, q, k_pool, v_pool, meta, iters: int) -> tuple[float, float]:
    """Milliseconds of the plain-XLA and the native step on the same inputs, after checking they agree."""
    outs = {name: step(q, k_pool, v_pool, meta) for name, step in steps.items()}
    np.testing.assert_allclose(outs["cpu"], outs["reference"], rtol=1e-4, atol=1e-5)
    return tuple(1e3 * time_call(steps[name], q, k_pool, v_pool, meta, iters=iters) for name in ("reference", "cpu"))


def make_pool(rng, storage: str) -> tuple[jax.Array, jax.Array | None]:
    """A pool of normal values stored as `storage`, built a layer at a time, and its scales (int8 only: max|x| / 127
    per token and kv head, as the engine writes them)."""
    pool = np.empty(POOL_SHAPE, np.int8 if storage == "int8" else np.dtype(storage))
    scales = np.empty(POOL_SHAPE[:-1], np.float32) if storage == "int8" else None
    for layer in range(LAYERS):
        values = rng.standard_normal(POOL_SHAPE[1:], np.float32)
        if storage == "int8":
            scales[layer] = np.abs(values).max(-1) / 127
            pool[layer] = np.round(values / scales[layer][..., None])
        else:
            pool[layer] = values.astype(jnp.bfloat16).view(np.uint16) if storage == "uint16" else values
    return jnp.asarray(pool), None if scales is None else jnp.asarray(scales)


def compare_pools(rng, args) -> None:
    """The native kernel's milliseconds per layer on each pool storage of `args.pools`, same cases."""
    assert kernels_cpu.load() is not None, kernels_cpu.build_error()
    pools = {}
    for storage in args.pools:
        (k_pool, k_scales), (v_pool, v_scales) = make_pool(rng, storage), make_pool(rng, storage)
        pools[storage] = (k_pool, v_pool, {} if k_scales is None else dict(k_scales=k_scales, v_scales=v_scales))
    step = jax.jit(lambda q, k, v, meta, scales: kernels_cpu.padded_paged_attention(
        q, k, v, jnp.int32(LAYER), meta.block_tables, meta.q_start, meta.lengths, sm_scale=0.125, **scales))
    first, *others = args.pools
    columns = [f"{storage} ms" for storage in args.pools] + [f"{other} / {first}" for other in others]
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, native kernel, median of {args.iters} per layer "
          f"(interleaved)")
    for header, cases in ((("decode rows", "context"), decode_cases(rng, args)),
                          (("prefill chunk", "cached before"), prefill_cases(rng, args))):
        print(f"\n| {' | '.join(header + tuple(columns))} |")
        print("|---" * (len(header) + len(columns)) + "|")
        for first_label, second_label, meta, q in cases:
            ms = time_interleaved({storage: functools.partial(step, q, *pool, meta=meta, scales=scales)
                                   for storage, (*pool, scales) in pools.items()}, args.iters)
            cells = [f"{ms[storage]:.2f}" for storage in args.pools] + [f"{ms[o] / ms[first]:.2f}" for o in others]
            print(f"| {first_label} | {second_label} | {' | '.join(cells)} |")


def time_interleaved(calls: dict, iters: int) -> dict[str, float]:
    """Median milliseconds of each call (after a warm-up of each), the calls taken in turn `iters` times."""
    for call in calls.values():
        jax.block_until_ready(call())
    times = {name: [] for name in calls}
    for _ in range(iters):
        for name, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(seconds) for name, seconds in times.items()}


if __name__ == "__main__":
    main()
