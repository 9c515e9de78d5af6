"""Compile time per program, lowering and XLA compilation apart, and the run time of what it compiles.

Builds the engine's `ModelRunner` on the default model (the embedded SmolLM2-135M GGUF) as the engine and precompile
do (`ModelRunner.for_engine` on the engine's bucket grid), then for one program of each kind, a decode step (16 rows,
2048 context), a prefill step (1 x 128 tokens), a mixed step (128 tokens over 64 rows) and the sampler of 64 rows,
times ``lower()`` and ``compile()`` of a fresh `jax.jit` (`ModelRunner.programs`, compiled with the engine's XLA
options: `runner/compiler_options.py`) with no persistent compile cache
(JAX's is off; the runner has no executable store) and the process's CPU seconds for both, and the fastest of
``--runs`` runs of the compiled program, in milliseconds:
the step with its sampler through `ModelRunner.execute` (greedy rows), and the sampler alone on greedy rows and on
random rows (temperature 0.8, top_p 0.95, top_k 50).

With ``--baseline-tree PATH`` (a worktree of another revision, e.g. ``git worktree add /work/wt-base main``) every
round runs this script twice in subprocesses, once with ``PYTHONPATH=PATH`` and once with this tree, one after the
other, and the table gives both (medians over the rounds) and their ratio (new / baseline): a shared machine's load
hits both alike.

    python scripts/bench_compile.py --dtype bfloat16 --dtype float32 --repeats 3
    python scripts/bench_compile.py --baseline-tree /work/wt-base --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

KINDS = ("decode", "prefill", "mixed", "sampler")
PROMPT_LOGPROBS = "prompt-logprobs"  # its own program since 2026-11-29 (before, in every prefill and mixed step)
COMPILE_PARTS = ("lower", "compile", "cpu")
RUN_KEYS = ("decode", "prefill", "mixed", "sampler_greedy", "sampler_random")
REPO_ROOT = Path(__file__).resolve().parents[1]


def build_runner(dtype: str):
    """The engine's runner for the default model in ``dtype``, with real weights (so its programs can run)."""
    import jax

    from jaxserve.compilation.sizing import engine_bucket_grid
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.distributed.sharding import engine_mesh
    from jaxserve.precision import resolve_engine_dtype
    from jaxserve.runner.model_runner import ModelRunner
    from jaxserve.weights import load_model

    jax.config.update("jax_enable_compilation_cache", False)
    mesh = engine_mesh(1)
    config = resolve_engine_dtype(EngineConfig(dtype=dtype), mesh.devices.flat[0])
    loaded = load_model(config.model, config.dtype, mesh=mesh)
    grid = engine_bucket_grid(config, loaded.config, loaded.params, jax.default_backend(), mesh)
    return ModelRunner.for_engine(loaded.config, loaded.params, config, grid, mesh), grid


def pick_buckets(grid) -> dict:
    """The measured bucket of each step kind from the grid (its narrowest context)."""
    from jaxserve.core.buckets import DecodeBucket, MixedBucket, PrefillBucket

    def narrowest(kind, **fields):
        found = [b for b in grid.buckets if isinstance(b, kind) and all(getattr(b, k) == v for k, v in fields.items())]
        if not found:
            raise SystemExit(f"the grid has no {kind.__name__} with {fields}")
        return min(found, key=lambda b: b.context_len)

    return {"decode": narrowest(DecodeBucket, batch_size=16), "prefill": narrowest(PrefillBucket, chunk_len=128),
            "mixed": narrowest(MixedBucket, num_tokens=128, batch_size=64)}


def compiler_options_of(runner, name: str):
    """The XLA options the engine compiles the program ``name`` with (`ModelRunner.compiler_options_of`; in a
    tree from before that method, its rule: a step in the engine's dtype, the rest in float32; none before the
    options existed)."""
    import jax.numpy as jnp

    if hasattr(runner, "compiler_options_of"):
        return runner.compiler_options_of(name)
    try:
        from jaxserve.runner.compiler_options import compiler_options
    except ImportError:
        return None
    return compiler_options(runner.platform, runner.dtype if name.startswith("step-") else jnp.float32)


def timed_compile(jitted, args, options=None) -> tuple[float, float, float, object]:
    """(seconds to lower, seconds to compile, CPU seconds of both, the executable) of a fresh jit, compiled with
    XLA ``options``. The CPU seconds (every thread of the process) vary less than the wall clock on a shared
    machine."""
    start, cpu_start = time.perf_counter(), time.process_time()
    lowered = jitted.lower(*args)
    lowered_at = time.perf_counter()
    compiled = lowered.compile(options)
    return lowered_at - start, time.perf_counter() - lowered_at, time.process_time() - cpu_start, compiled


def compile_kinds(runner, buckets: dict) -> dict:
    """{kind: (lower s, compile s, CPU s)}; the executables are handed to ``runner`` so its steps can run."""
    import jax

    from jaxserve.runner.input_batch import SampleShape, step_shape
    from jaxserve.runner.model_runner import executable_name, sampler_name

    shapes = {kind: step_shape(bucket, runner.block_size) for kind, bucket in buckets.items()}
    sample_shape = SampleShape(64)
    times = {}
    for kind in KINDS:
        jax.clear_caches()
        shape = shapes.get(kind)
        name = sampler_name(sample_shape) if shape is None else executable_name(shape)
        programs = runner.programs([shape] if shape is not None else [shapes["mixed"]], forks=False)
        *times[kind], compiled = timed_compile(*programs[name], compiler_options_of(runner, name))
        if shape is None:
            runner.sampler_executables[sample_shape] = compiled
        else:
            runner.executables[shape] = compiled
    helpers = runner.programs([], forks=True)
    if PROMPT_LOGPROBS in helpers:
        jax.clear_caches()
        options = compiler_options_of(runner, PROMPT_LOGPROBS)
        *times[PROMPT_LOGPROBS], _ = timed_compile(*helpers[PROMPT_LOGPROBS], options)
    for shape in shapes.values():  # the steps' own samplers (the mixed step's is the 64-row one)
        if shape.sample_shape not in runner.sampler_executables:
            runner.compile_sampler(shape.sample_shape)
    return times


def step_inputs(runner, kind: str, bucket, cached: int = 300):
    """Inputs of a typical step: decode rows at ``cached`` tokens, one 128-token prompt chunk, the mixed
    probe's rows (`runner/step_costs.py`)."""
    import numpy as np

    from jaxserve.runner.input_batch import StepInputs, step_shape
    from jaxserve.runner.sampler import SamplingTensors
    from jaxserve.runner.step_costs import probe_inputs

    if kind == "mixed":
        return probe_inputs(runner, bucket)
    shape = step_shape(bucket, runner.block_size)
    s, q = shape.input_shape
    cached = cached if kind == "decode" else 0
    lengths = np.full(s, cached + q, np.int32)
    sampling = SamplingTensors.from_rows([], s, runner.num_sampler_slots, runner.config.vocab_size)
    blocks = np.arange(s * shape.pages_per_seq, dtype=np.int32).reshape(s, shape.pages_per_seq) % runner.num_blocks
    num_groups = getattr(runner, "num_kv_groups", 1)  # KV cache groups (a baseline tree's runner may predate them)
    if num_groups > 1:  # every group on the same blocks: the time does not depend on which
        blocks = np.broadcast_to(blocks, (num_groups, *blocks.shape)).copy()
    return StepInputs(np.ones((s, q), np.int32), blocks, np.full(s, cached, np.int32), lengths,
                      np.full(s, q - 1, np.int32), sampling)


def fastest_ms(run, runs: int) -> float:
    """Milliseconds of the fastest of ``runs`` calls of ``run()`` (which blocks until its result is ready), after
    one untimed: on a shared machine the fastest run is the one least slowed by other processes."""
    run()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def sampler_tensors(runner, random: bool):
    from jaxserve.runner.sampler import SamplingRow, SamplingTensors

    floats = (0.8, 0.95, 0.0, 0.0, 0.0, 1.0) if random else (0.0, 1.0, 0.0, 0.0, 0.0, 1.0)
    rows = [SamplingRow(floats, top_k=50 if random else 0, seed=i, slot=i) for i in range(64)]
    return SamplingTensors.from_rows(rows, 64, runner.num_sampler_slots, runner.config.vocab_size)


def run_times(runner, buckets: dict, runs: int) -> dict:
    """Fastest ms of each kind's run: the steps through `execute`, the 64-row sampler alone on random logits."""
    import jax
    import numpy as np

    from jaxserve.runner.input_batch import SampleShape

    times = {}
    for kind, bucket in buckets.items():
        inputs = step_inputs(runner, kind, bucket)
        times[kind] = fastest_ms(lambda b=bucket, i=inputs: runner.execute(b, i).tokens.block_until_ready(), runs)
    logits = jax.device_put(np.random.default_rng(0).normal(size=(64, runner.config.vocab_size)).astype(np.float32))
    sampler = runner.sampler_executables[SampleShape(64)]
    for name, random in (("sampler_greedy", False), ("sampler_random", True)):
        sampling = sampler_tensors(runner, random)
        times[name] = fastest_ms(lambda s=sampling: sampler(runner.slot_state, logits, s)[0].block_until_ready(), runs)
    return times


def measure(dtype: str, runs: int) -> dict:
    """One round in this process: {"lower": {kind: s}, "compile": {kind: s}, "run_ms": {kind: ms}}."""
    runner, grid = build_runner(dtype)
    buckets = pick_buckets(grid)
    compiles = compile_kinds(runner, buckets)
    parts = {part: {kind: times[i] for kind, times in compiles.items()} for i, part in enumerate(COMPILE_PARTS)}
    return {**parts, "run_ms": run_times(runner, buckets, runs)}


def measure_in(tree: Path, dtype: str, runs: int) -> dict:
    """One round in a subprocess importing jaxserve from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, __file__, "--child", "--dtype", dtype, "--runs", str(runs)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def medians(rounds: list[dict]) -> dict:
    return {part: {k: statistics.median(r[part][k] for r in rounds) for k in rounds[0][part]}
            for part in rounds[0]}


def format_table(dtype: str, new: dict, base: dict | None) -> str:
    """Per kind: lower s, compile s, their CPU s, and with a baseline its wall and CPU totals and new / baseline;
    then each run's fastest ms (and the baseline's, and the ratio)."""
    lines = [f"dtype {dtype}  (seconds; medians over rounds)"]
    compare = "   base total  base cpu  ratio total  ratio cpu" if base else ""
    lines.append(f"{'program':16} {'lower':>7} {'compile':>8} {'total':>7} {'cpu':>7}" + compare)
    for kind in KINDS:  # then the prompt logprobs' program, once
        total = new["lower"][kind] + new["compile"][kind]
        line = f"{kind:16} {new['lower'][kind]:7.2f} {new['compile'][kind]:8.2f} {total:7.2f} {new['cpu'][kind]:7.2f}"
        if base:
            base_total = base["lower"][kind] + base["compile"][kind]
            line += (f"   {base_total:10.2f} {base['cpu'][kind]:9.2f} {total / base_total:12.2f}"
                     f" {new['cpu'][kind] / base['cpu'][kind]:10.2f}")
        lines.append(line)
    if PROMPT_LOGPROBS in new["lower"]:  # the baseline (before it) compiled it into each prefill and mixed step
        total = new["lower"][PROMPT_LOGPROBS] + new["compile"][PROMPT_LOGPROBS]
        lines.append(f"{PROMPT_LOGPROBS:16} {new['lower'][PROMPT_LOGPROBS]:7.2f} "
                     f"{new['compile'][PROMPT_LOGPROBS]:8.2f} {total:7.2f} {new['cpu'][PROMPT_LOGPROBS]:7.2f}")
    lines.append(f"{'run (fastest ms)':16} {'new':>7}" + (f" {'base':>8} {'ratio':>7}" if base else ""))
    for key in RUN_KEYS:
        line = f"{key:16} {new['run_ms'][key]:7.2f}"
        if base:
            line += f" {base['run_ms'][key]:8.2f} {new['run_ms'][key] / base['run_ms'][key]:7.2f}"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", action="append", choices=("bfloat16", "float32"),
                        help="repeatable; default both (bfloat16: the AVX512-BF16 path, float32: AVX2's auto)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, each with fresh jits (the median is shown)")
    parser.add_argument("--runs", type=int, default=20, help="timed runs of each compiled program")
    parser.add_argument("--baseline-tree", type=Path, help="a worktree of the revision to compare with")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtypes = args.dtype or ["bfloat16", "float32"]
    if args.child:
        print(json.dumps(measure(dtypes[0], args.runs)))
        return
    for dtype in dtypes:
        new_rounds, base_rounds = [], []
        for _ in range(args.repeats):
            if args.baseline_tree:
                base_rounds.append(measure_in(args.baseline_tree, dtype, args.runs))
            new_rounds.append(measure_in(REPO_ROOT, dtype, args.runs))
        print(format_table(dtype, medians(new_rounds), medians(base_rounds) if base_rounds else None), flush=True)


if __name__ == "__main__":
    main()
