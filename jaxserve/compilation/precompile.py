"""Precompile: every feasible bucket of an engine configuration into JAX's persistent compilation cache.

Place in the data flow: run once per (model, dtype, bucket file, engine limits, machine) before serving,
by `jaxserve precompile` or `scripts/precompile.py` (the same code). It derives the bucket grid exactly
as `LLMEngine` does (`engine_bucket_grid`), lowers every bucket from `ShapeDtypeStruct`s (parameter
shapes come from `jax.eval_shape` of the model's init: no weights are read and no device memory is
used), compiles them into the cache directory and records a manifest there. With a draft model
(`speculative_config` of method "draft_model") the grid is sized with the draft's weights and pool, as the engine
sizes it, and the draft's programs (its buckets, samplers and allocations, `speculative/draft_model.py`) are
compiled too. An engine started with the same `compile_cache_dir` then loads every executable instead of
compiling it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.attention.backends import get_attention_backend
from jaxserve.attention.kv_cache import pool_of_kinds
from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.compilation.compile_cache import (
    CacheCheck,
    CacheManifest,
    enable_persistent_cache,
    num_cache_entries,
    record_manifest,
    resolve_cache_dir,
)
from jaxserve.compilation.sizing import engine_bucket_grid
from jaxserve.compilation.warm_up import DEFAULT_COMPILE_THREADS, WarmUpReport, compile_buckets, use_compile_cache
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.model_config import ModelConfig
from jaxserve.core.buckets import BucketGrid
from jaxserve.distributed.multihost import distributed_init_requested, initialize_distributed
from jaxserve.distributed.sharding import engine_mesh
from jaxserve.logger import init_logger
from jaxserve.models import get_model_class
from jaxserve.precision import resolve_engine_dtype
from jaxserve.quantization.weights import apply_quantization
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.speculative.draft_model import check_draft_vocabulary, draft_buckets, draft_runner
from jaxserve.weights import load_config, resolve_model_path

logger = init_logger("jaxserve.compilation.precompile")


def abstract_params(model_config: ModelConfig, dtype: str) -> dict:
    """``{"params": ...}`` as ``ShapeDtypeStruct``s: the tree the weight loaders build, without weights."""
    model = get_model_class(model_config.architecture)(
        model_config, jnp.dtype(dtype), get_attention_backend("reference")
    )
    cfg = model_config
    kind = lambda heads, head_dim: jax.ShapeDtypeStruct((cfg.num_layers, heads, 1, 1, head_dim), jnp.dtype(dtype))
    pairs = tuple((kind(*shape), kind(*shape)) for shape in cfg.kv_page_shapes)  # a (K, V) pair per page shape
    i32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.int32)
    meta = AttentionMetadata(block_tables=i32(1, 1), q_start=i32(1), lengths=i32(1))

    def forward_and_logits(module, input_ids, kv_pool, meta):  # touches every parameter, lm_head included
        hidden, _ = module(input_ids, kv_pool, meta)
        return module.logits(hidden)

    init = lambda rng, ids, kv_pool, meta: model.init(rng, ids, kv_pool, meta, method=forward_and_logits)
    raw_key = jax.ShapeDtypeStruct((2,), jnp.uint32)  # abstract too: nothing runs, nothing compiles
    return _plain_dicts(jax.eval_shape(init, raw_key, i32(1, 1), pool_of_kinds(pairs), meta))


def abstract_draft(config: EngineConfig, target_config: ModelConfig) -> tuple[ModelConfig, dict] | None:
    """The draft model of ``config`` (`speculative_config` of method "draft_model") as its config and abstract
    params in the engine's dtype, checked as the engine loads it (`load_draft_model`); None without one."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    draft_config = dataclasses.replace(load_config(resolve_model_path(spec.model)), hybrid_kv_cache=False)
    check_draft_vocabulary(spec.model, draft_config, target_config)
    return draft_config, abstract_params(draft_config, config.dtype)


def _plain_dicts(tree: Any) -> Any:
    """Nested plain dicts, as the loaders build them (the pytree structure is part of the program)."""
    if hasattr(tree, "items"):
        return {key: _plain_dicts(value) for key, value in tree.items()}
    return tree


@dataclasses.dataclass
class PrecompileResult:
    cache_dir: Path
    grid: BucketGrid
    report: WarmUpReport
    check_before: CacheCheck  # what the directory held for this configuration before
    manifest: CacheManifest
    num_cache_entries: int
    draft_report: WarmUpReport | None = None  # the draft model's buckets (speculative_config's "draft_model")

    def describe(self) -> str:
        draft = [] if self.draft_report is None else [f"draft model: {self.draft_report.summary()}"]
        return "\n".join([
            self.report.format_table(),
            *draft,
            f"before: {self.check_before.describe()}",
            f"manifest recorded in {self.cache_dir} ({self.num_cache_entries} executables in the directory); "
            f"start the engine with compile_cache_dir={str(self.cache_dir)!r} "
            f"(--compile-cache-dir {self.cache_dir})",
        ])


def precompile(
    config: EngineConfig,
    cache_dir: str | Path | None = None,
    *,
    num_threads: int = DEFAULT_COMPILE_THREADS,
    progress: bool = False,
) -> PrecompileResult:
    """Compiles every feasible bucket of ``config`` into ``cache_dir`` (default: ``config.compile_cache_dir``,
    resolved as the engine does: ``$JAXSERVE_COMPILE_CACHE_DIR``, else ``~/.cache/jaxserve/compile_cache``)
    and records the manifest. A disabled cache (``""``) raises ValueError: precompiling needs a directory."""
    if distributed_init_requested(config.distributed_init):  # as LLMEngine does, before anything else
        initialize_distributed(config.coordinator_address, config.num_processes, config.process_id)
    path = enable_persistent_cache(resolve_cache_dir(
        config.compile_cache_dir if cache_dir is None else cache_dir, required=True
    ))
    mesh = engine_mesh(config.tensor_parallel_size)
    config = resolve_engine_dtype(config, mesh.devices.flat[0])
    model_path = resolve_model_path(config.model)
    model_config = load_config(model_path)
    model_config, params = apply_quantization(model_config, abstract_params(model_config, config.dtype),
                                              config.quantization)
    model_config = config.kv_cache_model_config(model_config, jax.default_backend())
    draft = abstract_draft(config, model_config)
    grid = engine_bucket_grid(config, model_config, params, jax.default_backend(), mesh, draft=draft)
    runner = ModelRunner.for_engine(model_config, params, config, grid, mesh, abstract=True)
    manifest = CacheManifest.current(
        model_config, config.dtype, grid, runner.backend.name, mesh.size, max_logprobs=config.max_logprobs,
        kv_cache_dtype=config.kv_cache_dtype, model=str(model_path), written_by="precompile",
    )
    logger.info("%s", grid.format_table())
    check = use_compile_cache(runner, path, manifest)
    report = compile_buckets(
        runner, grid.buckets, num_threads=num_threads, progress=progress, cache_dir=path, cache_check=check
    )
    runner.compile_allocations()  # the engine's only other programs: then its start compiles nothing
    draft_report = None if draft is None else _compile_draft(draft, config, grid, mesh, path, num_threads, progress)
    record_manifest(path, manifest)
    return PrecompileResult(path, grid, report, check, manifest, num_cache_entries(path), draft_report)


def _compile_draft(draft: tuple[ModelConfig, dict], config: EngineConfig, grid: BucketGrid, mesh, path: Path,
                   num_threads: int, progress: bool) -> WarmUpReport:
    """The draft model's programs, as the engine's warm-up builds them (through JAX's persistent cache): its buckets'
    steps and samplers and its allocations (pool, `no_tokens`, sampler state)."""
    runner, draft_grid = draft_runner(*draft, config, grid, mesh, abstract=True)
    report = compile_buckets(runner, draft_buckets(draft_grid), num_threads=num_threads, progress=progress,
                             cache_dir=path)
    runner.compile_allocations(forks=False)
    return report
