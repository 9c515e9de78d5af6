"""A decode step's time against its memory-bandwidth roofline: the bytes a step must read (every weight once,
every row's cached K/V) over the device's measured copy bandwidth.

Builds the engine on `--model` with `--buckets`, fills each chosen decode bucket's rows with `--cached` tokens
on pages of their own (no two rows share a page, so every K/V byte is read from memory) and times the step
through `ModelRunner.execute` (`runner/step_costs.py`: median of 30 after one untimed, the host's dispatch
included, the sampler included). Bandwidth: a jitted elementwise copy of 1 GiB (bytes read + written), in the
same run, and the data sheet's HBM figure where the device is known. Prints, per bucket: step ms, weight and
K/V GB read, roofline ms at the measured and at the data-sheet bandwidth, and step / roofline for each.

    python scripts/bench_decode_roofline.py --model /tmp/llama-1b --buckets .gpu/grid.toml --batches 64,256
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's jaxserve, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))

COPY_BYTES = 1 << 30
COPY_RUNS = 20
# HBM bandwidth of the data sheet, bytes/s, by jax's device_kind: the roofline's second, stricter column
SPEC_BANDWIDTH = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H100 PCIe": 2.0e12}


def own_pages(rows: int, tokens: int, block_size: int, width: int, first: int = 0) -> np.ndarray:
    """Block tables of ``rows`` rows holding ``tokens`` tokens each on pages of their own, from page ``first``."""
    pages = -(-tokens // block_size)
    tables = np.zeros((rows, width), np.int32)
    tables[:, :pages] = first + np.arange(rows * pages, dtype=np.int32).reshape(rows, pages)
    return tables


def decode_inputs(runner, bucket, cached: int):
    """Every row of the bucket decoding its token `cached` + 1, its pages its own (rows r * pages .. )."""
    from jaxserve.runner.input_batch import StepInputs, step_shape
    from jaxserve.runner.sampler import SamplingTensors

    shape = step_shape(bucket, runner.block_size)
    rows = shape.batch_size
    tables = own_pages(rows, cached + 1, runner.block_size, shape.pages_per_seq)
    lengths = np.full(rows, cached + 1, np.int32)
    return StepInputs(np.zeros((rows, 1), np.int32), tables, lengths - 1, lengths, np.zeros(rows, np.int32),
                      SamplingTensors.from_rows([], rows, runner.num_sampler_slots, runner.config.vocab_size))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--buckets", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="64,256", help="decode buckets' batch sizes, comma-separated")
    parser.add_argument("--cached", type=int, default=1023, help="tokens each row has cached before its step")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    args = parser.parse_args(argv)

    import jax
    from bench_kernels import copy_bandwidth

    from jaxserve import LLM
    from jaxserve.compilation.sizing import kv_bytes_per_block
    from jaxserve.runner.step_costs import median_step_seconds

    llm = LLM(args.model, dtype=args.dtype, buckets=args.buckets, max_model_len=args.max_model_len,
              num_kv_blocks=args.num_kv_blocks)
    engine = llm.llm_engine
    runner, model_config = engine.runner, engine.model_config
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.params))
    token_bytes = kv_bytes_per_block(  # K and V of one token, every layer
        num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads, block_size=1,
        head_dim=model_config.head_dim, dtype_bytes=jax.tree.leaves(runner.kv_pool)[0].dtype.itemsize)
    bandwidth = copy_bandwidth(COPY_BYTES, COPY_RUNS)
    kind = jax.devices()[0].device_kind
    spec = SPEC_BANDWIDTH.get(kind, bandwidth)
    batches = {int(b) for b in args.batches.split(",")}
    print(f"# decode step against its roofline on {kind}, jax {jax.__version__}")
    print(f"weights {weight_bytes / 1e9:.3f} GB, K/V {token_bytes} bytes per token, copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s (read + write), data sheet {spec / 1e12:.2f} TB/s, {args.cached} tokens "
          "cached per row\n")
    print("| decode bucket | step ms | weights GB | K/V GB | roofline ms (copy) | step / it | roofline ms (sheet) "
          "| step / it |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for bucket in engine.grid.decode_buckets:
        if bucket.batch_size not in batches or bucket.context_len <= args.cached:
            continue
        seconds = median_step_seconds(runner, bucket, decode_inputs(runner, bucket, args.cached), runs=30)
        kv = bucket.batch_size * (args.cached + 1) * token_bytes
        roofline, sheet = (weight_bytes + kv) / bandwidth, (weight_bytes + kv) / spec
        print(f"| {bucket.batch_size} rows x {bucket.context_len} | {seconds * 1e3:.2f} | {weight_bytes / 1e9:.3f} "
              f"| {kv / 1e9:.3f} | {roofline * 1e3:.2f} | {seconds / roofline:.2f}x | {sheet * 1e3:.2f} "
              f"| {seconds / sheet:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
