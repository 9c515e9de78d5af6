"""Weight load time: an orbax checkpoint restored straight into its sharding against a Hugging Face
safetensors directory read on the host and then placed on the mesh (what `LLM(model=...)` does for each); with
`--gguf-cache`, `load_model` of the embedded GGUF without, missing and hitting the converted-weights cache.

    python scripts/bench_load.py                          # the embedded SmolLM2-135M, converted twice
    python scripts/bench_load.py --hf-dir path/to/model --repeats 5 --dtype bfloat16
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python scripts/bench_load.py --tensor-parallel-size 4
    python scripts/bench_load.py --gguf-cache --dtype bfloat16 --repeats 3

`--gguf-cache`: each load in a fresh process, the three kinds interleaved in every repeat: the cache off
(JAXSERVE_WEIGHTS_CACHE_DIR=""), a miss (an empty cache directory: parse, convert and store) and a hit (a directory
holding the entry); timed: the imports, `load_model(None, dtype)` (of which the tokenizer) and the placement of the
params on one device (a hit's arrays are mapped, read when placed).

With no `--hf-dir`, the embedded GGUF dequantized by transformers as a float32 safetensors directory is used
(`baselines.embedded_hf_dir()`, made once under ~/.cache/jaxserve-baselines/); it is converted to orbax with
scripts/convert_checkpoint.py under `--work-dir`.
Each load is timed from the files to device arrays that are ready (`block_until_ready`), weights only
(the tokenizer is the same for both); the median of `--repeats` runs is reported, files in the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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


def child_gguf_load(dtype: str) -> dict:
    """One timed `load_model` of the embedded GGUF in this (fresh) process; the cache as the environment says."""
    start = time.perf_counter()
    import jax

    import jaxserve.weights as weights
    from jaxserve.distributed.sharding import make_mesh, shard_params

    imported = time.perf_counter()
    tokenizer_seconds = []
    load_tokenizer = weights.load_tokenizer

    def timed_tokenizer(path):
        began = time.perf_counter()
        tokenizer = load_tokenizer(path)
        tokenizer_seconds.append(time.perf_counter() - began)
        return tokenizer

    weights.load_tokenizer = timed_tokenizer
    loaded = weights.load_model(None, dtype)
    loaded_at = time.perf_counter()
    jax.block_until_ready(shard_params(loaded.params, make_mesh(1)))
    return {"import_s": imported - start, "load_model_s": loaded_at - imported, "tokenizer_s": tokenizer_seconds[0],
            "place_s": time.perf_counter() - loaded_at}


def _spawn_gguf_load(dtype: str, cache_dir: str) -> dict:
    env = {**os.environ, "JAXSERVE_WEIGHTS_CACHE_DIR": cache_dir, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    result = subprocess.run([sys.executable, __file__, "--child-gguf-load", "--dtype", dtype], env=env,
                            capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"load failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_gguf_cache(dtype: str, repeats: int) -> str:
    """Cache off, miss and hit interleaved in each of ``repeats`` rounds, each load in a fresh process."""
    load = os.getloadavg()
    runs: dict[str, list[dict]] = {"cache off": [], "miss (convert + store)": [], "hit": []}
    with tempfile.TemporaryDirectory(prefix="bench_load_cache_") as tmp:
        _spawn_gguf_load(dtype, f"{tmp}/warm")  # the hits' entry
        for repeat in range(repeats):
            for name, cache_dir in zip(runs, ("", f"{tmp}/miss{repeat}", f"{tmp}/warm"), strict=True):
                runs[name].append(_spawn_gguf_load(dtype, cache_dir))
                print(f"{name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    lines = [f"embedded SmolLM2-135M-Instruct GGUF, {dtype}, {os.cpu_count()} CPUs, load average {load[0]:.1f} "
             f"before, {os.getloadavg()[0]:.1f} after; medians of {repeats} fresh processes (runs in brackets)", "",
             "| load | `load_model` s | of which tokenizer s | placement s | imports s |", "|---|---|---|---|---|"]
    for name, measured in runs.items():
        cells = [_median_cell([m[key] for m in measured]) for key in ("load_model_s", "tokenizer_s", "place_s",
                                                                       "import_s")]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    ratio = [hit["load_model_s"] / off["load_model_s"] for hit, off in zip(runs["hit"], runs["cache off"], strict=True)]
    lines += ["", f"hit / cache off, `load_model`, per round: {', '.join(f'{r:.2f}' for r in ratio)}"]
    return "\n".join(lines)


def _median_cell(seconds: list[float]) -> str:
    return f"{statistics.median(seconds):.2f} ({', '.join(f'{s:.2f}' for s in seconds)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-dir", default=None, help="a safetensors model directory (default: embedded model)")
    parser.add_argument("--work-dir", default=None, help="where the converted copies go (default: a temp dir)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gguf-cache", action="store_true",
                        help="the embedded GGUF's load_model without, missing and hitting the converted-weights cache")
    parser.add_argument("--child-gguf-load", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_gguf_load:
        print(json.dumps(child_gguf_load(args.dtype)))
        return 0
    if args.gguf_cache:
        print(run_gguf_cache(args.dtype, args.repeats))
        return 0

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
