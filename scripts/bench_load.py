"""Weight load time: an orbax checkpoint restored straight into its sharding against a Hugging Face
safetensors directory read on the host and then placed on the mesh (what `LLM(model=...)` does for each).

    python scripts/bench_load.py                          # the embedded SmolLM2-135M, converted twice
    python scripts/bench_load.py --hf-dir path/to/model --repeats 5 --dtype bfloat16
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python scripts/bench_load.py --tensor-parallel-size 4

With no `--hf-dir`, the embedded GGUF dequantized by transformers as a float32 safetensors directory is used
(`baselines.embedded_hf_dir()`, made once under ~/.cache/jaxserve-baselines/); it is converted to orbax with
scripts/convert_checkpoint.py under `--work-dir`.
Each load is timed from the files to device arrays that are ready (`block_until_ready`), weights only
(the tokenizer is the same for both); the median of `--repeats` runs is reported, files in the page cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's jaxserve, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))


def load_safetensors(hf_dir: Path, dtype: str, mesh):
    import jax

    from jaxserve.distributed.sharding import shard_params
    from jaxserve.weights.safetensors_dir import load_safetensors_dir, read_hf_config

    params = shard_params(load_safetensors_dir(hf_dir, read_hf_config(hf_dir), dtype), mesh)
    return jax.block_until_ready(params)


def load_orbax(orbax_dir: Path, dtype: str, mesh):
    import jax

    from jaxserve.weights.orbax_dir import load_orbax_dir

    return jax.block_until_ready(load_orbax_dir(orbax_dir, dtype, mesh)[1])


def timed(fn, repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
        del result
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-dir", default=None, help="a safetensors model directory (default: embedded model)")
    parser.add_argument("--work-dir", default=None, help="where the converted copies go (default: a temp dir)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import jax
    from baselines import embedded_hf_dir
    from convert_checkpoint import convert

    from jaxserve.distributed.sharding import make_mesh

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_load_"))
    work.mkdir(parents=True, exist_ok=True)
    hf_dir = Path(args.hf_dir) if args.hf_dir else embedded_hf_dir()
    orbax_dir = work / f"orbax-{args.dtype}"
    if not orbax_dir.exists():
        convert(str(hf_dir), orbax_dir, args.dtype)
    mesh = make_mesh(args.tensor_parallel_size)
    params = load_orbax(orbax_dir, args.dtype, mesh)
    num_params = sum(x.size for x in jax.tree.leaves(params))
    del params
    results = {
        "safetensors (host read + device_put)": timed(lambda: load_safetensors(hf_dir, args.dtype, mesh), args.repeats),
        "orbax (restore into sharding)": timed(lambda: load_orbax(orbax_dir, args.dtype, mesh), args.repeats),
    }
    print(f"{num_params / 1e6:.1f}M parameters, dtype {args.dtype}, {jax.default_backend()} x "
          f"{args.tensor_parallel_size}, median of {args.repeats}")
    print("| format | median s | runs (s) |\n|---|---|---|")
    for name, seconds in results.items():
        print(f"| {name} | {statistics.median(seconds):.2f} | {', '.join(f'{s:.2f}' for s in seconds)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
