"""Benchmark the GPU (Triton) paged-attention kernels against the XLA reference and the memory roofline.

On a GPU machine this compiles the kernels for real (interpret=False), checks each configuration against
the jnp reference on random data (the first sequences of each batch), then times:
  * decode (`paged_attention`) for batch sizes 1..256 and contexts 512..8192, next to the XLA reference and
    the roofline time = K/V bytes read / measured device copy bandwidth;
  * chunked prefill (`prefill_attention`) for a few batch sizes, next to the XLA reference (TFLOP/s);
  * ragged (`ragged_paged_attention`, the mixed steps' kernel): `batch` decode rows and one prefill chunk in
    one flat batch, next to the XLA reference and the decode rows' roofline.
Prints markdown tables, one set per pool dtype: bfloat16, float32, or int8 (`kv_cache_dtype="int8"`: int8 pages
with a float32 scale per token and kv head, bfloat16 queries; the reference reads the pool dequantized in its own
program, so compare int8 with bfloat16's kernel times). A configuration that differs from the reference is
reported and the sweep goes on; the exit status is 1 if any did.

    python scripts/bench_kernels.py            # full sweep on a GPU
    python scripts/bench_kernels.py --quick    # small sweep
    python scripts/bench_kernels.py --dtype bfloat16,float32 --batches 64,256 --contexts 1024,8192
    python scripts/bench_kernels.py --dtype bfloat16,int8 --quick      # the int8 KV cache against bfloat16's
    python scripts/bench_kernels.py --interpret --quick   # CPU smoke test (interpret mode, tiny shapes)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.attention.kv_cache import ScaledPages  # noqa: E402
from jaxserve.math_utils import cdiv  # noqa: E402
from kernels_pallas._common import GPU_PLATFORMS  # noqa: E402
from kernels_pallas.paged_attention import paged_attention, paged_attention_reference  # noqa: E402
from kernels_pallas.prefill_attention import prefill_attention, prefill_attention_reference  # noqa: E402
from kernels_pallas.ragged_paged_attention import (  # noqa: E402
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

FULL = {"batches": [1, 4, 16, 64, 256], "contexts": [512, 2048, 8192], "prefill_batches": [1, 4, 16]}
QUICK = {"batches": [1, 16], "contexts": [512, 2048], "prefill_batches": [1]}
INTERPRET = {"batches": [1, 2], "contexts": [64, 128], "prefill_batches": [1]}
CHECK_SEQS = 4  # sequences compared against the reference per configuration
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "int8": 3e-2}
KERNELS = ("decode", "prefill", "ragged")
FAILURES: list[str] = []  # configurations whose kernel output differed from the reference


@dataclasses.dataclass(frozen=True)
class Shape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sweep")
    p.add_argument("--interpret", action="store_true", help="CPU smoke test: interpret mode, tiny shapes")
    p.add_argument("--heads", default="32:8", help="num_q_heads:num_kv_heads (default 32:8)")
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256))
    p.add_argument("--page-size", type=int, default=16, choices=(16, 32, 64, 128))
    p.add_argument("--dtype", default="bfloat16", help="pool dtypes, comma-separated: bfloat16, float32, int8")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk length (default 512)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per measurement")
    p.add_argument("--kernel", default="decode,prefill,ragged", help=f"comma-separated, of {', '.join(KERNELS)}")
    p.add_argument("--batches", default=None, help="decode and ragged batch sizes, comma-separated (default: sweep's)")
    p.add_argument("--contexts", default=None, help="context lengths, comma-separated (default: the sweep's)")
    p.add_argument("--prefill-batches", default=None, help="prefill batch sizes, comma-separated (default: sweep's)")
    p.add_argument(
        "--ref-mem-gb", type=float, default=16.0, help="skip the XLA reference above this gather size"
    )
    args = p.parse_args(argv)
    args.dtypes = args.dtype.split(",")
    args.kernels = args.kernel.split(",")
    for name, values, allowed in (("--dtype", args.dtypes, TOLERANCE), ("--kernel", args.kernels, KERNELS)):
        if unknown := [v for v in values if v not in allowed]:
            p.error(f"{name}: unknown {unknown}; choose from {', '.join(allowed)}")
    return args


def chosen_sweep(args, default: dict) -> dict:
    """The default sweep with the batch and context lists the command line gave."""
    sweep = dict(default)
    given = {"batches": args.batches, "contexts": args.contexts, "prefill_batches": args.prefill_batches}
    for key, value in given.items():
        if value:
            sweep[key] = [int(v) for v in value.split(",")]
    return sweep


def time_call(fn, *args, iters: int) -> float:
    """Median wall time of fn(*args) in seconds, after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_kernel_and_reference(kernel, reference, inputs: tuple, iters: int, run_reference: bool):
    """(kernel seconds, XLA reference seconds or None where it is not run) on the same inputs, each `time_call`'s
    median."""
    t_kernel = time_call(kernel, *inputs, iters=iters)
    return t_kernel, time_call(reference, *inputs, iters=iters) if run_reference else None


def copy_bandwidth(nbytes: int, iters: int) -> float:
    """Device bytes/s moved by an elementwise copy (reads + writes) of an nbytes array."""
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    seconds = time_call(jax.jit(lambda a: a + 1.0), x, iters=iters)
    return 2 * x.nbytes / seconds


def make_pool(key, shape: Shape, batch: int, context: int):
    """Random pool with each sequence's pages scattered over it; all sequences hold `context` tokens. An int8
    pool's pages are `ScaledPages` (values in -127..127, scales of about 1/127, as normal K/V would get)."""
    pages_per_seq = cdiv(context, shape.page_size)
    total_pages = batch * pages_per_seq
    dims = (shape.num_kv_heads, total_pages, shape.page_size, shape.head_dim)
    kk, kv, kp = jax.random.split(key, 3)
    table = jax.random.permutation(kp, total_pages).reshape(batch, pages_per_seq).astype(jnp.int32)
    pages = lambda key: random_pages(key, dims, shape.dtype)
    return pages(kk), pages(kv), table, jnp.full((batch,), context, jnp.int32)


def random_pages(key, dims: tuple, dtype: str):
    if dtype != "int8":
        return jax.random.normal(key, dims, jnp.dtype(dtype))
    values = jax.random.randint(key, dims, -127, 128, jnp.int32).astype(jnp.int8)
    return ScaledPages(values, jax.random.uniform(key, dims[:-1], jnp.float32, 0.5 / 127, 2 / 127))


def query_dtype(shape: Shape) -> jnp.dtype:
    """q's dtype: the pool's, bfloat16 over an int8 pool."""
    return jnp.dtype(jnp.bfloat16 if shape.dtype == "int8" else shape.dtype)


def kernel_call(fn, **options):
    """fn(q, k, v, *rest, **options) on pools as `make_pool` gives them: an int8 pool's scales as k_scales /
    v_scales."""
    def call(q, k, v, *rest):
        if isinstance(k, ScaledPages):
            return fn(q, k.values, v.values, *rest, k_scales=k.scales, v_scales=v.scales, **options)
        return fn(q, k, v, *rest, **options)
    return call


def reference_call(fn, **options):
    """The XLA reference fn(q, k, v, *rest, **options) on the pools' values (an int8 pool dequantized to q's
    dtype)."""
    def call(q, k, v, *rest):
        if isinstance(k, ScaledPages):
            k, v = ((p.values.astype(jnp.float32) * p.scales[..., None]).astype(q.dtype) for p in (k, v))
        return fn(q, k, v, *rest, **options)
    return call


def kv_bytes(shape: Shape, batch: int, context: int) -> int:
    """K/V bytes the context occupies (an int8 pool's float32 scales included)."""
    scale_bytes = 4 if shape.dtype == "int8" else 0
    value_bytes = shape.head_dim * jnp.dtype(shape.dtype).itemsize + scale_bytes
    return 2 * batch * context * shape.num_kv_heads * value_bytes


def reference_fits(shape: Shape, batch: int, context: int, limit_gb: float, chunk: int = 1) -> bool:
    """Whether the XLA reference's float32 K/V gather and logits stay under limit_gb."""
    gathered = 2 * batch * context * shape.num_kv_heads * shape.head_dim * 4
    logits = batch * shape.num_q_heads * chunk * context * 4
    return (gathered + 2 * logits) / 1e9 <= limit_gb


def check(name: str, out, ref, dtype: str) -> None:
    """Records (and prints) a configuration whose kernel output is off the reference by more than the dtype's
    tolerance."""
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    if not np.isfinite(err) or err > TOLERANCE[dtype]:
        FAILURES.append(f"{name} {dtype}: kernel differs from the reference (max abs error {err:.3g})")
        print(f"FAILED: {FAILURES[-1]}", flush=True)


def bench_decode(args, shape: Shape, sweep: dict, bandwidth: float) -> list[str]:
    kernel = jax.jit(kernel_call(paged_attention, backend="gpu", interpret=args.interpret))
    reference = jax.jit(reference_call(paged_attention_reference))
    rows = [
        "| batch | context | kernel us | XLA ref us | roofline us | % of roofline | speedup vs XLA |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(rows), flush=True)
    for batch in sweep["batches"]:
        for context in sweep["contexts"]:
            key = jax.random.PRNGKey(batch * 100_003 + context)
            k_pages, v_pages, table, lengths = make_pool(key, shape, batch, context)
            q = jax.random.normal(key, (batch, shape.num_q_heads, shape.head_dim), query_dtype(shape))
            n = min(batch, CHECK_SEQS)
            check(
                f"decode b={batch} ctx={context}",
                kernel(q, k_pages, v_pages, lengths, table)[:n],
                reference(q[:n], k_pages, v_pages, lengths[:n], table[:n]),
                shape.dtype,
            )
            t_kernel, t_ref = time_kernel_and_reference(
                kernel, reference, (q, k_pages, v_pages, lengths, table), args.iters,
                reference_fits(shape, batch, context, args.ref_mem_gb))
            t_roof = kv_bytes(shape, batch, context) / bandwidth
            rows.append(
                f"| {batch} | {context} | {t_kernel * 1e6:.1f} | {_us(t_ref)} | {t_roof * 1e6:.1f} "
                f"| {100 * t_roof / t_kernel:.0f}% | {_ratio(t_ref, t_kernel)} |"
            )
            print(rows[-1], flush=True)
    return rows


def bench_prefill(args, shape: Shape, sweep: dict) -> list[str]:
    chunk = min(args.chunk, min(sweep["contexts"]))
    kernel = jax.jit(kernel_call(prefill_attention, backend="gpu", interpret=args.interpret))
    reference = jax.jit(reference_call(prefill_attention_reference))
    rows = [
        f"| batch | context (last chunk of {chunk}) | kernel us | XLA ref us | kernel TFLOP/s "
        "| speedup vs XLA |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(rows), flush=True)
    for batch in sweep["prefill_batches"]:
        for context in sweep["contexts"]:
            key = jax.random.PRNGKey(batch * 7 + context)
            k_pages, v_pages, table, lengths = make_pool(key, shape, batch, context)
            q = jax.random.normal(
                key, (batch, chunk, shape.num_q_heads, shape.head_dim), query_dtype(shape)
            )
            q_start = lengths - chunk
            args_ = (q, k_pages, v_pages, table, q_start, lengths)
            n = min(batch, CHECK_SEQS)
            check(
                f"prefill b={batch} ctx={context}",
                kernel(*args_)[:n],
                reference(q[:n], k_pages, v_pages, table[:n], q_start[:n], lengths[:n]),
                shape.dtype,
            )
            t_kernel, t_ref = time_kernel_and_reference(
                kernel, reference, args_, args.iters, reference_fits(shape, batch, context, args.ref_mem_gb, chunk))
            # causal chunk at the end of the context: each query row sees (context - chunk + i + 1) keys
            keys_seen = chunk * (context - chunk) + chunk * (chunk + 1) / 2
            flops = 4 * batch * shape.num_q_heads * shape.head_dim * keys_seen
            rows.append(
                f"| {batch} | {context} | {t_kernel * 1e6:.1f} | {_us(t_ref)} "
                f"| {flops / t_kernel / 1e12:.2f} | {_ratio(t_ref, t_kernel)} |"
            )
            print(rows[-1], flush=True)
    return rows


def ragged_rows(batch: int, context: int, chunk: int):
    """Row arrays of a mixed step: `batch` decode rows (one token at position context - 1) and one prefill
    chunk of `chunk` tokens ending at position context - 1, as `ragged_paged_attention` takes them."""
    query_lens = np.array([1] * batch + [chunk], np.int32)
    query_starts = np.concatenate([[0], np.cumsum(query_lens)[:-1]]).astype(np.int32)
    positions = np.array([context - 1] * batch + [context - chunk], np.int32)
    lengths = np.full(batch + 1, context, np.int32)
    return tuple(jnp.asarray(x) for x in (query_starts, query_lens, positions, lengths))


def ragged_inputs(shape: Shape, batch: int, context: int, chunk: int):
    key = jax.random.PRNGKey(batch * 31 + context)
    k_pages, v_pages, table, _ = make_pool(key, shape, batch + 1, context)
    q = jax.random.normal(key, (batch + chunk, shape.num_q_heads, shape.head_dim), query_dtype(shape))
    return (q, k_pages, v_pages, table, *ragged_rows(batch, context, chunk))


def bench_ragged(args, shape: Shape, sweep: dict, bandwidth: float) -> list[str]:
    chunk = min(args.chunk, min(sweep["contexts"]))
    sm_scale = shape.head_dim**-0.5
    kernel = jax.jit(kernel_call(ragged_paged_attention, sm_scale=sm_scale, backend="gpu", interpret=args.interpret))
    reference = jax.jit(reference_call(ragged_paged_attention_reference, sm_scale=sm_scale))
    rows = [
        f"| decode rows | context (+ one chunk of {chunk}) | kernel us | XLA ref us | decode rows' roofline us "
        "| speedup vs XLA |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(rows), flush=True)
    for batch in sweep["batches"]:
        for context in sweep["contexts"]:
            small = ragged_inputs(shape, min(batch, CHECK_SEQS), context, chunk)
            check(f"ragged b={batch} ctx={context}", kernel(*small), reference(*small), shape.dtype)
            inputs = ragged_inputs(shape, batch, context, chunk)
            t_kernel, t_ref = time_kernel_and_reference(
                kernel, reference, inputs, args.iters, reference_fits(shape, batch + chunk, context, args.ref_mem_gb))
            t_roof = kv_bytes(shape, batch, context) / bandwidth
            rows.append(
                f"| {batch} | {context} | {t_kernel * 1e6:.1f} | {_us(t_ref)} | {t_roof * 1e6:.1f} "
                f"| {_ratio(t_ref, t_kernel)} |"
            )
            print(rows[-1], flush=True)
    return rows


def _us(seconds: float | None) -> str:
    return "skipped" if seconds is None else f"{seconds * 1e6:.1f}"


def _ratio(t_ref: float | None, t_kernel: float) -> str:
    return "-" if t_ref is None else f"{t_ref / t_kernel:.2f}x"


def main(argv=None) -> None:
    args = parse_args(argv)
    platform = jax.default_backend()
    if not args.interpret and platform not in GPU_PLATFORMS:
        raise SystemExit(
            f"no GPU (jax backend is {platform!r}); use --interpret --quick for a CPU smoke test"
        )
    num_q_heads, num_kv_heads = (int(x) for x in args.heads.split(":"))
    if args.interpret:
        sweep, args.iters, copy_bytes = INTERPRET, min(args.iters, 2), 1 << 24
    else:
        sweep, copy_bytes = (QUICK if args.quick else FULL), 1 << 30
    sweep = chosen_sweep(args, sweep)
    bandwidth = copy_bandwidth(copy_bytes, args.iters)
    mode = "interpret" if args.interpret else "compiled"
    print(f"# paged attention on {jax.devices()[0].device_kind} ({mode}, jax {jax.__version__})")
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)\n")
    benches = {
        "decode": ("decode (paged_attention)", lambda shape: bench_decode(args, shape, sweep, bandwidth)),
        "prefill": ("chunked prefill (prefill_attention)", lambda shape: bench_prefill(args, shape, sweep)),
        "ragged": ("mixed step (ragged_paged_attention)", lambda shape: bench_ragged(args, shape, sweep, bandwidth)),
    }
    for dtype in args.dtypes:
        if args.interpret:
            shape = Shape(4, 2, 64, 16, dtype)
        else:
            shape = Shape(num_q_heads, num_kv_heads, args.head_dim, args.page_size, dtype)
        for kernel in args.kernels:
            title, bench = benches[kernel]
            print(f"## {title}, {shape}\n")
            bench(shape)
            print()
    if FAILURES:
        raise SystemExit("kernels differing from the reference:\n" + "\n".join(FAILURES))
    print("every kernel output matched the reference")


if __name__ == "__main__":
    main()
