"""Where a GPU step's time goes: `jax.profiler` traces of the engine's decode, prefill and mixed steps, summed
by kernel, and the attention kernels' launch knobs swept at the engine's shape, timed by their device time.

Builds the engine on `--model` with `--buckets` (as `bench_decode_roofline.py`; rows on pages of their own), then
for each step: its wall time (median of `--runs`, the host's dispatch and the sampler included) and a trace of
`--iters` runs (`gpu_trace.py`: kernels, device busy time, the wall time the device was idle, the top kernels).
Steps: decode at each of `--batches` rows with `--cached` tokens per row; a prefill of one `--chunk`-token prompt;
mixed steps of D decode rows (`--mixed-decode-rows`) and one fresh chunk of the rest of the mixed bucket's tokens.
With `--sweep`: the decode (`paged_attention`), ragged and prefill kernels alone at the model's heads, every
variant in one trace, each timed by its own kernels' device time (per jitted program), next to XLA's reference.
Traces go to `--trace-dir` (a .tar.gz of them with `--archive`), the figures to `--json`.

    python scripts/profile_gpu_steps.py --model /tmp/llama-3.2-1b-random --buckets scripts/gpu_bench_buckets.toml \
        --num-kv-blocks 32768 --batches 16,64,256 --mixed-decode-rows 16,64 --sweep
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's jaxserve, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode_roofline import decode_inputs, own_pages  # noqa: E402
from gpu_trace import device_kernels, format_summary, summarise, traced  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--buckets", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--batches", default="16,256", help="decode buckets' batch sizes to profile")
    p.add_argument("--cached", type=int, default=1023, help="tokens each decode row has cached")
    p.add_argument("--chunk", type=int, default=512, help="the prefill step's prompt tokens")
    p.add_argument("--mixed-decode-rows", default="16,64", help="decode rows of the profiled mixed steps")
    p.add_argument("--runs", type=int, default=20, help="timed runs per step (wall time, untraced)")
    p.add_argument("--iters", type=int, default=5, help="traced runs per step")
    p.add_argument("--sweep", action="store_true", help="also sweep the attention kernels' knobs")
    p.add_argument("--sweep-only", default=None, metavar="HQ:HKV:D",
                   help="only the kernel sweep (no engine), at these query heads, kv heads and head_dim")
    p.add_argument("--sweep-rows", default="16,64,256", help="decode rows of the sweep's calls")
    p.add_argument("--sweep-context", type=int, default=1024, help="tokens of each decode row in the sweep")
    p.add_argument("--interpret", action="store_true", help="the sweep in Pallas' interpreter (a CPU smoke test)")
    p.add_argument("--trace-dir", type=Path, default=Path("/tmp/jaxserve-gpu-traces"))
    p.add_argument("--archive", type=Path, default=None, help="write the traces to this .tar.gz")
    p.add_argument("--json", type=Path, default=None, help="write every summary to this file")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------- engine steps


def build_engine(args):
    from jaxserve import LLM

    return LLM(args.model, dtype=args.dtype, buckets=args.buckets, max_model_len=args.max_model_len,
               num_kv_blocks=args.num_kv_blocks, attention_backend=args.attention_backend).llm_engine


def prefill_inputs(runner, bucket, chunk: int):
    from jaxserve.runner.input_batch import StepInputs, step_shape
    from jaxserve.runner.sampler import SamplingTensors

    shape = step_shape(bucket, runner.block_size)
    rows = shape.batch_size
    lengths = np.zeros(rows, np.int32)
    lengths[0] = chunk
    sample_index = np.zeros(rows, np.int32)
    sample_index[0] = chunk - 1
    tables = own_pages(rows, chunk, runner.block_size, shape.pages_per_seq)
    return StepInputs(np.zeros(shape.input_shape, np.int32), tables, np.zeros(rows, np.int32), lengths, sample_index,
                      SamplingTensors.from_rows([], rows, runner.num_sampler_slots, runner.config.vocab_size))


def mixed_inputs(runner, bucket, decode_rows: int, cached: int):
    """``decode_rows`` rows decoding token ``cached`` + 1 and one fresh prompt chunk of the bucket's other tokens,
    every row on pages of its own."""
    from jaxserve.runner.input_batch import StepInputs, step_shape
    from jaxserve.runner.sampler import SamplingTensors

    shape = step_shape(bucket, runner.block_size)
    chunk = shape.num_query_tokens - decode_rows
    num_tokens = [1] * decode_rows + [chunk]
    rows = len(num_tokens)
    query_starts = np.full(shape.batch_size, shape.num_query_tokens, np.int32)
    query_starts[:rows] = np.cumsum([0, *num_tokens[:-1]])
    q_start, lengths, sample_index = (np.zeros(shape.batch_size, np.int32) for _ in range(3))
    q_start[:decode_rows] = cached
    lengths[:decode_rows] = cached + 1
    lengths[decode_rows] = chunk
    sample_index[:rows] = np.asarray(num_tokens) - 1
    tables = np.zeros((shape.batch_size, shape.pages_per_seq), np.int32)
    tables[:decode_rows] = own_pages(decode_rows, cached + 1, runner.block_size, shape.pages_per_seq)
    tables[decode_rows] = own_pages(1, chunk, runner.block_size, shape.pages_per_seq, first=int(tables.max()) + 1)[0]
    return StepInputs(np.zeros(shape.input_shape, np.int32), tables, q_start, lengths, sample_index,
                      SamplingTensors.from_rows([], shape.batch_size, runner.num_sampler_slots,
                                                runner.config.vocab_size), query_starts=query_starts)


def engine_steps(engine, args) -> list[tuple[str, object, object]]:
    """(label, bucket, inputs) of every step to profile that the grid has a bucket for."""
    runner, grid = engine.runner, engine.grid
    steps = []
    for batch in (int(b) for b in args.batches.split(",")):
        bucket = next((b for b in grid.decode_buckets if b.batch_size == batch and b.context_len > args.cached), None)
        if bucket is not None:
            steps.append((f"decode {batch} rows x {args.cached + 1} tokens", bucket,
                          decode_inputs(runner, bucket, args.cached)))
    prefill = next((b for b in grid.prefill_buckets if b.chunk_len >= args.chunk), None)
    if prefill is not None:
        steps.append((f"prefill 1 x {args.chunk}", prefill, prefill_inputs(runner, prefill, args.chunk)))
    for rows in (int(r) for r in args.mixed_decode_rows.split(",") if r):
        mixed = next((b for b in grid.mixed_buckets if b.batch_size > rows and b.num_tokens > rows), None)
        if mixed is not None:
            steps.append((f"mixed {rows} decode rows + {mixed.num_tokens - rows}-token chunk ({mixed.num_tokens} "
                          f"tokens, {mixed.batch_size} rows)", mixed, mixed_inputs(runner, mixed, rows, args.cached)))
    return steps


def profile_step(runner, label: str, bucket, inputs, args, index: int) -> dict:
    from jaxserve.runner.step_costs import median_step_seconds

    wall = median_step_seconds(runner, bucket, inputs, runs=args.runs)
    run = lambda: runner.execute(bucket, inputs).tokens.block_until_ready()
    path = traced(run, args.iters, args.trace_dir / f"step{index}")
    summary = summarise(device_kernels(path), args.iters, wall_s=wall)
    print(format_summary(label, summary) + "\n", flush=True)
    return summary


# ------------------------------------------------------------------------------------------- kernel sweep


def named_jit(name: str, fn):
    """``jax.jit(fn)`` whose HLO module is ``jit_<name>``: the trace tells its kernels apart."""
    import jax

    fn.__name__ = fn.__qualname__ = name
    return jax.jit(fn)


def sweep_variants(config) -> list[tuple[str, str, dict]]:
    """(kernel, variant name, knobs): the shipped knobs first, then one knob changed at a time."""
    variants = [("decode", "default", {})]
    variants += [("decode", f"ppb{n}", {"pages_per_compute_block": n}) for n in (4, 16, 32)]
    variants += [("decode", "warps8", {"num_warps": 8}), ("decode", "warps2", {"num_warps": 2})]
    variants += [("decode", f"stages{n}", {"num_stages": n}) for n in (1, 3)]
    variants += [("decode", f"splits{n}", {"num_splits": n}) for n in (1, 2, 4, 8)]
    variants += [("ragged", "default", {})]
    variants += [("ragged", f"ppb{n}", {"pages_per_compute_block": n}) for n in (4, 8)]
    variants += [("ragged", "bq32_ppb4", {"block_q": 32, "pages_per_compute_block": 4})]
    variants += [("ragged", "warps8_ppb8", {"num_warps": 8, "pages_per_compute_block": 8})]
    variants += [("prefill", "default", {})]
    variants += [("prefill", f"bq{q}_ppb{p}", {"block_q": q, "pages_per_compute_block": p})
                 for q, p in ((64, 4), (64, 8), (128, 4), (32, 8))]
    variants += [("prefill", "bq64_ppb8_warps8", {"block_q": 64, "pages_per_compute_block": 8, "num_warps": 8})]
    return variants


def sweep_inputs(config, rows: int, context: int, chunk: int, width: int):
    """Random bfloat16 pool, decode queries for ``rows`` rows of ``context`` tokens, a ragged batch of them and one
    fresh chunk, and the chunk alone; tables ``width`` pages wide (the engine's), each row on pages of its own."""
    import jax
    import jax.numpy as jnp

    page = 16
    hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    total = (rows + 1) * width
    keys = jax.random.split(jax.random.PRNGKey(rows), 5)
    k = jax.random.normal(keys[0], (hkv, total, page, d), jnp.bfloat16)
    v = jax.random.normal(keys[1], (hkv, total, page, d), jnp.bfloat16)
    tables = jnp.asarray(own_pages(rows + 1, width * page, page, width))
    tables = tables.at[rows].set(jnp.asarray(own_pages(1, chunk, page, width, first=rows * width)[0]))
    q_dec = jax.random.normal(keys[2], (rows, hq, d), jnp.bfloat16)
    q_chunk = jax.random.normal(keys[3], (1, chunk, hq, d), jnp.bfloat16)
    lengths = jnp.full((rows,), context, jnp.int32)
    ragged = dict(
        q=jnp.concatenate([q_dec, q_chunk[0]]), tables=tables,
        query_starts=jnp.asarray(np.concatenate([np.arange(rows), [rows]]).astype(np.int32)),
        query_lens=jnp.asarray(np.array([1] * rows + [chunk], np.int32)),
        positions=jnp.asarray(np.array([context - 1] * rows + [0], np.int32)),
        lengths=jnp.asarray(np.array([context] * rows + [chunk], np.int32)),
    )
    return dict(k=k, v=v, q_dec=q_dec, lengths=lengths, tables=tables[:rows], q_chunk=q_chunk,
                chunk_table=tables[rows:], ragged=ragged, chunk=chunk)


def kernel_fn(kind: str, knobs: dict, x: dict, reference: bool = False, interpret: bool = False):
    """A thunk running one attention call on the sweep's inputs (blocking on its result)."""
    from kernels_pallas.paged_attention import paged_attention, paged_attention_reference
    from kernels_pallas.prefill_attention import prefill_attention, prefill_attention_reference
    from kernels_pallas.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference

    r, d = x["ragged"], x["q_dec"].shape[-1]
    knobs = dict(knobs, interpret=True) if interpret else knobs
    chunk_start = np.zeros(1, np.int32)
    chunk_len = np.full(1, x["chunk"], np.int32)
    if kind == "decode":
        f = paged_attention_reference if reference else lambda *a: paged_attention(*a, backend="gpu", **knobs)
        args = (x["q_dec"], x["k"], x["v"], x["lengths"], x["tables"])
    elif kind == "ragged":
        f = (lambda *a: ragged_paged_attention_reference(*a, sm_scale=d**-0.5)) if reference else (
            lambda *a: ragged_paged_attention(*a, sm_scale=d**-0.5, backend="gpu", **knobs))
        args = (r["q"], x["k"], x["v"], r["tables"], r["query_starts"], r["query_lens"], r["positions"], r["lengths"])
    else:
        f = prefill_attention_reference if reference else lambda *a: prefill_attention(*a, backend="gpu", **knobs)
        args = (x["q_chunk"], x["k"], x["v"], x["chunk_table"], chunk_start, chunk_len)
    return f, args


def kernel_sweep(config, args) -> list[dict]:
    """Every variant at every decode row count, in one trace per row count; device us per call of each."""
    import jax
    from bench_kernels import time_call

    rows_list, context = [int(r) for r in args.sweep_rows.split(",")], args.sweep_context
    width = -(-args.max_model_len // 16)
    results = []
    for rows in rows_list:
        x = sweep_inputs(config, rows, context, args.chunk, width)
        calls = {}
        for kind, name, knobs in sweep_variants(config) + [(k, "xla_reference", None) for k in
                                                            ("decode", "ragged", "prefill")]:
            if kind == "prefill" and rows != rows_list[0]:
                continue  # the chunk alone does not depend on the decode rows
            f, a = kernel_fn(kind, knobs or {}, x, reference=knobs is None, interpret=args.interpret)
            module = f"{kind}_{name}_r{rows}"
            jitted = named_jit(module, f)
            try:
                jax.block_until_ready(jitted(*a))
            except Exception as error:  # a variant the kernel refuses: reported, the sweep goes on
                print(f"{module}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                continue
            calls[module] = (kind, name, jitted, a)

        def run_all(calls=calls):
            for _, _, jitted, a in calls.values():
                for _ in range(5):
                    jitted(*a)
                jax.block_until_ready(jitted(*a))

        path = traced(run_all, 2, args.trace_dir / f"sweep{rows}")
        kernels = device_kernels(path)
        matched = any(module in k.module for k in kernels for module in calls)
        for module, (kind, name, jitted, a) in calls.items():
            if matched:  # 2 traced rounds of 6 calls
                mine = [k for k in kernels if module in k.module]
                us, launches = sum(k.duration_ns for k in mine) / 12 / 1e3, len(mine) / 12
            else:  # the trace names no programs: wall time, the host's dispatch included
                us, launches = time_call(jitted, *a, iters=10) * 1e6, float("nan")
            results.append({"kernel": kind, "variant": name, "rows": rows, "us": us, "device_time": matched,
                            "launches": launches})
            print(f"| {kind} | {name} | {rows} | {us:.1f}{'' if matched else ' (wall)'} | {launches:.1f} |",
                  flush=True)
    return results


def bandwidth(nbytes: int = 1 << 32) -> dict:
    """Device-to-device copy rate of an nbytes bfloat16 array (read + write) by the copy kernel's device time."""
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.PRNGKey(0), (nbytes // 2,), jnp.bfloat16)
    copy = named_jit("bandwidth_copy", lambda a: a * 2)
    jax.block_until_ready(copy(x))
    path = traced(lambda: jax.block_until_ready(copy(x)), 10, "/tmp/jaxserve-gpu-traces/bandwidth")
    ns = [k.duration_ns for k in device_kernels(path) if "bandwidth_copy" in k.module]
    seconds = statistics.median(ns) / 1e9 if ns else float("nan")
    return {"bytes": 2 * nbytes, "seconds": seconds, "bytes_per_s": 2 * nbytes / seconds}


# ------------------------------------------------------------------------------------------- main


def main(argv=None) -> None:
    args = parse_args(argv)
    import jax

    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "steps": {}, "sweep": []}
    if jax.default_backend() == "gpu":
        report["bandwidth"] = bandwidth()
        print(f"copy bandwidth (device time): {report['bandwidth']['bytes_per_s'] / 1e12:.2f} TB/s\n", flush=True)
    config = None
    if not args.sweep_only:
        start = time.perf_counter()
        engine = build_engine(args)
        print(f"engine built in {time.perf_counter() - start:.1f} s (layers scanned: "
              f"{engine.runner.model.scan_layers})\n", flush=True)
        config = engine.model_config
        for index, (label, bucket, inputs) in enumerate(engine_steps(engine, args)):
            report["steps"][label] = profile_step(engine.runner, label, bucket, inputs, args, index)
    if args.sweep or args.sweep_only:
        if config is None:
            hq, hkv, d = (int(n) for n in args.sweep_only.split(":"))
            config = argparse.Namespace(num_heads=hq, num_kv_heads=hkv, head_dim=d)
        print("| kernel | variant | decode rows | device us per call | launches |\n|---|---|---:|---:|---:|",
              flush=True)
        report["sweep"] = kernel_sweep(config, args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if args.archive:
        with tarfile.open(args.archive, "w:gz") as tar:
            tar.add(args.trace_dir, arcname="traces")


if __name__ == "__main__":
    main()
