"""Precompile for hardware this host does not have: every bucket compiled for a TPU topology, or lowered for CUDA.

Place in the data flow: `jaxserve precompile --target NAME` (and `scripts/check_targets.py`). It builds the
engine exactly as a server on the target would (`target_engine`: `engine_bucket_grid` with the target chips' HBM
instead of this host's memory, so the KV pool leaves room for the largest steps' temporaries, measured by compiling
them for the target (`sizing.py`), and a draft model's weights and pool counted as the engine counts them; abstract
weights, the Pallas backend with the target's kernel variant, tensor parallel over the topology's chips), lists
every program it will build (`plan_for_target`, `program_list.py`; `--list` stops there and compiles nothing, not
even the sizing's largest steps) and then, per program (every bucket's step, the sampler programs, the allocation
programs and the fork programs; with a draft model also the draft's steps, samplers and allocations, reported as
"draft ..." programs but never stored: the engine's warm-up reads them through JAX's persistent cache):

- TPU: compiles it deviceless with the real TPU compiler and Mosaic, reads its `memory_analysis()` and
  stores the serialized executable in the compile cache directory's `ExecutableStore` (keyed by the
  manifest, whose platform and device kind are the target's) with a manifest entry, so that a TPU host
  started with the same flags and directory loads it instead of compiling;
- CUDA: lowers it through the Triton kernels (`lowering_platforms=("cuda",)`); compiling needs a GPU.

The report is a table per program (seconds; argument, output, aliased, temporary and code bytes; their sum
against HBM per device) and the list of programs that failed or do not fit.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.compilation.compile_cache import CacheManifest, record_manifest, resolve_cache_dir
from jaxserve.compilation.executable_store import ExecutableStore
from jaxserve.compilation.precompile import abstract_draft, abstract_params
from jaxserve.compilation.program_list import Program, format_program_list, runner_programs
from jaxserve.compilation.sizing import engine_bucket_grid, largest_of_each_kind
from jaxserve.compilation.targets import CompileTarget, auto_tensor_parallel_size, resolve_target
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.model_config import ModelConfig
from jaxserve.core.buckets import BucketGrid
from jaxserve.distributed.sharding import TP_AXIS, check_tensor_parallel
from jaxserve.logger import init_logger
from jaxserve.precision import resolve_engine_dtype
from jaxserve.quantization.weights import apply_quantization
from jaxserve.runner.input_batch import StepShape, step_shape
from jaxserve.runner.model_runner import ModelRunner, executable_name, sample_shapes, sampler_name
from jaxserve.speculative.draft_model import draft_buckets, draft_runner
from jaxserve.weights import load_config, resolve_model_path

MB = 1e6
logger = init_logger("jaxserve.compilation.target_compile")


@dataclasses.dataclass(frozen=True)
class ProgramResult:
    """One program built for the target: its memory per device (TPU), or only that it lowered (CUDA)."""

    name: str
    seconds: float
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0  # outputs that reuse donated arguments (the KV pool, the sampler state)
    temp_bytes: int = 0
    code_bytes: int = 0
    error: str | None = None

    @property
    def total_bytes(self) -> int:
        """Device memory while it runs: arguments, outputs not aliased to arguments, temporaries, code."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes


@dataclasses.dataclass
class TargetReport:
    target: CompileTarget
    grid: BucketGrid
    tensor_parallel_size: int
    programs: list[ProgramResult]
    cache_dir: Path | None = None

    def failures(self) -> list[str]:
        """Programs that failed to compile (lower) or, on a TPU, do not fit in a device's HBM."""
        failed = [f"{p.name}: {p.error}" for p in self.programs if p.error]
        if not self.target.lower_only:
            hbm = self.target.hbm_bytes_per_device
            failed += [
                f"{p.name}: needs {p.total_bytes / MB:.0f} MB of {hbm / MB:.0f} MB HBM per device"
                for p in self.programs if not p.error and p.total_bytes > hbm
            ]
        return failed

    def format_table(self) -> str:
        t = self.target
        verb = "lowered for" if t.lower_only else "compiled for"
        head = (
            f"{len(self.programs)} programs {verb} {t.name} ({t.device_kind}, {len(t.devices)} devices, "
            f"tensor parallel {self.tensor_parallel_size}); KV pool {self.grid.num_blocks} blocks of "
            f"{self.grid.block_size} tokens"
        )
        if t.lower_only:
            rows = [(p.name, f"{p.seconds:.2f}", "failed (below)" if p.error else "lowered") for p in self.programs]
            return "\n".join([head, *_table(("program", "seconds", "result"), rows), *self._failure_lines()])
        hbm = t.hbm_bytes_per_device
        rows = [
            (p.name, f"{p.seconds:.2f}", *(f"{b / MB:.1f}" for b in (p.argument_bytes, p.output_bytes, p.alias_bytes,
                                                                      p.temp_bytes, p.code_bytes, p.total_bytes)),
             "failed (below)" if p.error else f"{100 * p.total_bytes / hbm:.1f}%")
            for p in self.programs
        ]
        headers = ("program", "seconds", "args MB", "out MB", "alias MB", "temp MB", "code MB", "total MB",
                   f"of {hbm / MB:.0f} MB")
        return "\n".join([head, *_table(headers, rows), *self._failure_lines()])

    def _failure_lines(self) -> list[str]:
        failures = self.failures()
        if failures:
            return [f"{len(failures)} failed:", *(f"  {f}" for f in failures)]
        return ["every program lowered" if self.target.lower_only else "every program fits"]


def _table(headers, rows) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )
    return [line(headers), line(["-" * w for w in widths]), *map(line, rows)]


def target_mesh(target: CompileTarget, tensor_parallel_size: int) -> Mesh:
    if tensor_parallel_size > len(target.devices):
        raise ValueError(
            f"tensor_parallel_size ({tensor_parallel_size}) exceeds the {len(target.devices)} devices of target "
            f"{target.name}"
        )
    return Mesh(np.array(target.devices[:tensor_parallel_size]), (TP_AXIS,))


def target_dtype(config: EngineConfig, target: CompileTarget) -> EngineConfig:
    """``config`` with its dtype resolved for the target's chips. The CUDA target's devices are this host's CPUs
    standing in for the GPU (an H100: bf16 tensor cores), so "auto" is bfloat16 there whatever this CPU has."""
    if target.platform == "cuda" and config.dtype == "auto":
        logger.info("dtype bfloat16 (dtype=auto: the CUDA target's tensor cores run bfloat16 matmuls)")
        return dataclasses.replace(config, dtype="bfloat16")
    return resolve_engine_dtype(config, target.devices[0])


@dataclasses.dataclass(frozen=True)
class TargetEngine:
    """What an engine on the target runs on, built on this host: abstract weights, the target's mesh, the grid."""

    config: EngineConfig  # the Pallas backend, dtype and tensor parallel size resolved for the target
    target: CompileTarget
    mesh: Mesh
    model_path: Path
    model_config: ModelConfig
    params: dict  # ShapeDtypeStructs, quantized as configured
    draft: tuple[ModelConfig, dict] | None  # a draft model's config and abstract params (`abstract_draft`)
    grid: BucketGrid


def target_engine(config: EngineConfig, target_name: str, tensor_parallel_size: int | None = None, *,
                  fit_to_steps: bool = True) -> TargetEngine:
    """The engine of ``config`` on ``target_name``, its grid sized as `build_engine_parts` sizes it there: the target
    chips' HBM for the device's memory, a draft model's weights and pool counted (``tensor_parallel_size`` None: as
    many of the target's devices as the model's heads divide evenly). ``fit_to_steps=False``: the pool the memory
    budget alone gives, without compiling the largest steps to fit it to them (a CUDA target never fits them)."""
    model_path = resolve_model_path(config.model)
    model_config = load_config(model_path)
    config = dataclasses.replace(config, attention_backend="pallas")  # the kernels, as an engine there picks them
    target = resolve_target(target_name, tensor_parallel_size or 1)
    if tensor_parallel_size is None:
        # a pool of latents (MLA) is whole on every device: its one kv head does not bound the split
        kv_heads = model_config.num_heads if model_config.kv_values_in_keys else model_config.num_kv_heads
        heads = (model_config.num_heads, kv_heads, model_config.intermediate_size)
        tensor_parallel_size = 1 if target.lower_only else auto_tensor_parallel_size(len(target.devices), *heads)
    check_tensor_parallel(model_config, tensor_parallel_size)
    mesh = target_mesh(target, tensor_parallel_size)
    config = dataclasses.replace(target_dtype(config, target), tensor_parallel_size=tensor_parallel_size)
    model_config, params = apply_quantization(model_config, abstract_params(model_config, config.dtype),
                                              config.quantization)
    model_config = config.kv_cache_model_config(model_config, target.platform)
    draft = abstract_draft(config, model_config)
    grid = engine_bucket_grid(config, model_config, params, target.platform, mesh, target.hbm_bytes_per_device,
                              fit_to_steps=fit_to_steps and not target.lower_only, draft=draft)
    return TargetEngine(config, target, mesh, model_path, model_config, params, draft, grid)


@dataclasses.dataclass(frozen=True)
class TargetPlan:
    """What a target compile builds, before it builds anything: the engine, its runner and step shapes, the draft
    model's runner and step shapes (None without one), and every program by name (`program_list.py`)."""

    built: TargetEngine
    runner: ModelRunner
    shapes: list[StepShape]
    draft: tuple[ModelRunner, list[StepShape]] | None
    programs: list[Program]

    def format_programs(self) -> str:
        t = self.built.target
        verb = "to lower for" if t.lower_only else "to compile for"
        return format_program_list(self.programs, f"{verb} {t.name}")


def plan_for_target(config: EngineConfig, target_name: str, *, tensor_parallel_size: int | None = None,
                    max_buckets: int | None = None, largest_only: bool = False,
                    fit_to_steps: bool = True) -> TargetPlan:
    """The programs `compile_for_target` builds (its arguments; ``fit_to_steps=False`` compiles nothing at all: the KV
    pool is then the memory budget's, before the largest steps' needs give some blocks back)."""
    built = target_engine(config, target_name, tensor_parallel_size, fit_to_steps=fit_to_steps)
    runner = ModelRunner.for_engine(built.model_config, built.params, built.config, built.grid, built.mesh,
                                    abstract=True, platform=built.target.platform)
    shapes = _step_shapes(built.grid, built.grid.buckets, max_buckets, largest_only)
    programs = runner_programs(runner, shapes)
    draft = None
    if built.draft is not None:
        draft_run, draft_grid = draft_runner(*built.draft, built.config, built.grid, built.mesh, abstract=True,
                                             platform=built.target.platform)
        draft = (draft_run, _step_shapes(draft_grid, draft_buckets(draft_grid), max_buckets, largest_only))
        programs += runner_programs(draft_run, draft[1], forks=False, prefix="draft ")
    return TargetPlan(built, runner, shapes, draft, programs)


def compile_for_target(
    config: EngineConfig,
    target_name: str,
    *,
    tensor_parallel_size: int | None = None,
    cache_dir: str | None = None,
    max_buckets: int | None = None,
    largest_only: bool = False,
) -> TargetReport:
    """Builds every program of ``config``'s engine for ``target_name`` (see the module docstring).

    ``tensor_parallel_size`` None: as many of the target's devices as the model's heads divide evenly.
    ``max_buckets``: only the first buckets of the grid, and of a draft model's grid (tests); ``largest_only``: only
    the largest step of each kind (prefill, decode, mixed), the quick worst-case check. Executables go to
    ``cache_dir`` (resolved like ``EngineConfig.compile_cache_dir``; disabled: none are stored) for TPU targets.
    A draft model's programs (``speculative_config``'s "draft_model") are built too, as "draft ..." programs of the
    report, but never stored in the executable store: the engine's warm-up reads them through JAX's persistent
    cache, and a draft identical to the target would collide with the target's names."""
    plan = plan_for_target(config, target_name, tensor_parallel_size=tensor_parallel_size, max_buckets=max_buckets,
                           largest_only=largest_only)
    return compile_plan(plan, cache_dir)


def compile_plan(plan: TargetPlan, cache_dir: str | None = None) -> TargetReport:
    """Builds the programs of ``plan`` (`compile_for_target`), logging their list first."""
    logger.info("%s", plan.format_programs())
    built, runner, shapes = plan.built, plan.runner, plan.shapes
    config, target, mesh, grid = built.config, built.target, built.mesh, built.grid
    if target.lower_only:
        programs = _lower_all(runner, shapes) + _draft_programs(plan)
        return TargetReport(target, grid, mesh.size, programs)
    path = resolve_cache_dir(config.compile_cache_dir if cache_dir is None else cache_dir)
    manifest = CacheManifest.current(
        built.model_config, config.dtype, grid, runner.backend.name, mesh.size, max_logprobs=config.max_logprobs,
        kv_cache_dtype=config.kv_cache_dtype, device=target.devices[0], model=str(built.model_path),
        written_by=f"precompile --target {target.name}",
    )
    if path is not None:
        runner.executable_store = ExecutableStore(path, manifest, num_devices=len(target.devices))
    programs = _compile_all(runner, shapes) + _draft_programs(plan)
    if path is not None and not any(p.error for p in programs):
        record_manifest(path, manifest)
    return TargetReport(target, grid, mesh.size, programs, path)


def _step_shapes(grid: BucketGrid, buckets, max_buckets: int | None, largest_only: bool) -> list:
    shapes = list(dict.fromkeys(step_shape(b, grid.block_size) for b in buckets))[:max_buckets]
    return largest_of_each_kind(shapes) if largest_only else shapes


def _draft_programs(plan: TargetPlan) -> list[ProgramResult]:
    """The draft model's programs built for the target (none without one), named "draft ...": its steps and
    samplers and its allocations (it never forks). Its runner has no executable store: nothing of it is stored."""
    if plan.draft is None:
        return []
    runner, shapes = plan.draft
    if plan.built.target.lower_only:
        programs = _lower_all(runner, shapes, forks=False)
    else:
        programs = _compile_all(runner, shapes, forks=False)
    return [dataclasses.replace(p, name=f"draft {p.name}") for p in programs]


def _compile_all(runner: ModelRunner, shapes, *, forks: bool = True) -> list[ProgramResult]:
    """Every step of ``shapes``, the sampler program of each of their sample shapes, then the allocations and
    (``forks``) the forks."""
    programs = [(executable_name(shape), lambda shape=shape: runner.compile(shape)) for shape in shapes]
    programs += [(sampler_name(shape), lambda shape=shape: runner.compile_sampler(shape))
                 for shape in sample_shapes(shapes)]
    results = []
    for i, (name, compile_program) in enumerate(programs):
        results.append(_compile_program(name, compile_program))
        done = results[-1]
        outcome = done.error or f"{done.total_bytes / MB:.0f} MB per device"
        logger.info("%s (%d of %d) in %.1fs: %s", done.name, i + 1, len(programs), done.seconds, outcome)
    start = time.perf_counter()
    try:
        helpers = runner.compile_allocations(forks=forks)
    except Exception as err:  # noqa: BLE001
        return [*results, ProgramResult("allocations and forks", time.perf_counter() - start, error=_brief(err))]
    seconds = (time.perf_counter() - start) / max(len(helpers), 1)
    return [*results, *(_measured(name, seconds, compiled) for name, compiled in helpers.items())]


def _compile_program(name: str, compile_program) -> ProgramResult:
    start = time.perf_counter()
    try:
        compiled = compile_program()
    except Exception as err:  # noqa: BLE001 - reported per program, the others still compile
        return ProgramResult(name, time.perf_counter() - start, error=_brief(err))
    return _measured(name, time.perf_counter() - start, compiled)


def _measured(name: str, seconds: float, compiled: jax.stages.Compiled) -> ProgramResult:
    memory = compiled.memory_analysis()
    return ProgramResult(
        name, seconds, argument_bytes=memory.argument_size_in_bytes, output_bytes=memory.output_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes, temp_bytes=memory.temp_size_in_bytes,
        code_bytes=memory.generated_code_size_in_bytes,
    )


def _lower_all(runner: ModelRunner, shapes, *, forks: bool = True) -> list[ProgramResult]:
    """Lowers every program for CUDA (through the Triton kernels; ``forks``: the forks too); compiling them needs a
    GPU."""
    results = []
    for name, (jitted, args) in runner.programs(shapes, forks=forks).items():
        start = time.perf_counter()
        try:
            jitted.trace(*args).lower(lowering_platforms=("cuda",))
        except Exception as err:  # noqa: BLE001 - reported per program, the others still lower
            results.append(ProgramResult(name, time.perf_counter() - start, error=_brief(err)))
            continue
        results.append(ProgramResult(name, time.perf_counter() - start))
    return results


def _brief(err: Exception) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return text[0][:300] if text else type(err).__name__
