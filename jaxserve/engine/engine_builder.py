"""Building an engine: everything the request loop runs on, and its warm-up.

Place in the data flow: `LLMEngine.__init__` calls `build_engine_parts`, which joins jax.distributed where asked,
turns the persistent compile cache on before anything compiles, builds the device mesh, resolves the dtype,
loads and quantizes the model (and a draft model), sizes the bucket grid and the KV pool
(`compilation/sizing.py`), and builds the block manager, the scheduler, the step runner (`runner/step_runner.py`),
the draft proposer and the KV event publisher; with a latency target the scheduler's step budget and the step
runner's timer share the step costs that serving teaches (`core/cost_model.py`, `runner/step_costs.py`).
`warm_up_engine` then compiles, or loads from the compile cache, every bucket's executable
(`compilation/warm_up.py`), or with `background_compile` only the covering set, handing the other buckets to a
`BackgroundCompiler` (`compilation/background.py`) whose thread builds them while the engine serves. Nothing
compiles on the step path.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from jaxserve.compilation.background import BackgroundCompiler
from jaxserve.compilation.compile_cache import (
    CACHE_DIR_ENV,
    CacheManifest,
    record_manifest,
    resolve_cache_dir,
    use_persistent_cache,
)
from jaxserve.compilation.sizing import engine_bucket_grid, kv_cache_summary
from jaxserve.compilation.warm_up import WarmUpReport, compile_bucket, compile_buckets, use_compile_cache
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.kv_events_config import KVEventsConfig
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.buckets import BucketGrid
from jaxserve.core.cost_model import StepCosts
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.step_budget import StepBudget
from jaxserve.distributed.multihost import distributed_init_requested, initialize_distributed
from jaxserve.distributed.sharding import engine_mesh
from jaxserve.engine.kv_events import KVEventPublisher, binds
from jaxserve.logger import init_logger
from jaxserve.precision import resolve_engine_dtype
from jaxserve.quantization.weights import apply_quantization
from jaxserve.runner.step_runner import StepRunner
from jaxserve.speculative.draft_model import DraftModelProposer, build_draft_proposer, load_draft_model
from jaxserve.speculative.ngram import NgramProposer
from jaxserve.speculative.proposer import Proposer
from jaxserve.speculative.suffix import SuffixProposer
from jaxserve.weights import LoadedModel, load_model

logger = init_logger("jaxserve.engine.engine_builder")


@dataclasses.dataclass
class EngineParts:
    """What an engine is built from, ready to warm up."""

    config: EngineConfig  # as given, with its dtype resolved for the mesh's devices
    compile_cache_dir: Path | None  # the persistent compile cache (absolute; None: disabled)
    mesh: jax.sharding.Mesh
    model: LoadedModel  # quantized as configured
    grid: BucketGrid
    block_manager: BlockManager
    scheduler: Scheduler
    runner: StepRunner
    proposer: Proposer | None
    kv_event_publisher: KVEventPublisher | None
    # the grid's buckets beyond the covering set, while they build (warm-up replaces it; empty: nothing to build)
    background: BackgroundCompiler = dataclasses.field(default_factory=lambda: BackgroundCompiler(None, []))


def build_engine_parts(config: EngineConfig, loaded: LoadedModel | None = None) -> EngineParts:
    """Everything an engine with ``config`` runs on (``loaded``: the model already loaded, else loaded here)."""
    if distributed_init_requested(config.distributed_init):
        initialize_distributed(config.coordinator_address, config.num_processes, config.process_id)
    # set before anything compiles, so that every executable is cached
    compile_cache_dir = use_persistent_cache(resolve_cache_dir(config.compile_cache_dir))
    if compile_cache_dir is None:
        logger.info("persistent compile cache: disabled (compile_cache_dir='' or %s='')", CACHE_DIR_ENV)
    else:
        logger.info("persistent compile cache: %s", compile_cache_dir)
    mesh = engine_mesh(config.tensor_parallel_size, config.data_parallel_rank)
    config = resolve_engine_dtype(config, mesh.devices.flat[0])
    loaded = loaded or load_model(config.model, config.dtype, mesh=mesh, quantization=config.quantization)
    model_config, params = apply_quantization(loaded.config, loaded.params, config.quantization)
    loaded = dataclasses.replace(loaded, config=config.kv_cache_model_config(model_config, jax.default_backend()),
                                 params=params)
    spec = config.speculative_config
    draft = None
    if spec is not None and spec.method == "draft_model":
        draft = load_draft_model(spec.model, loaded.config, config.dtype, mesh)
    grid = engine_bucket_grid(config, loaded.config, loaded.params, jax.default_backend(), mesh,
                              draft=None if draft is None else (draft.config, draft.params))
    for line in kv_cache_summary(grid, loaded.config.kv_cache_layout).splitlines():
        logger.info("%s", line)
    layout = loaded.config.kv_cache_layout
    block_manager = BlockManager(grid.num_blocks, grid.block_size, enable_prefix_caching=config.enable_prefix_caching,
                                 group_windows=layout.windows, group_kinds=layout.group_kinds,
                                 kind_blocks=grid.blocks_of_kinds(layout))
    scheduler = Scheduler(
        block_manager, grid, max_num_seqs=grid.max_num_seqs, max_num_batched_tokens=grid.max_num_batched_tokens,
        policy=config.scheduling_policy,
        **({} if config.waiting_served_ratio is None else {"waiting_served_ratio": config.waiting_served_ratio}),
    )
    logger.info("%s", _scheduling_summary(scheduler))
    runner = StepRunner.for_engine(loaded.config, loaded.params, config, grid, mesh)
    _learn_step_costs(config, grid, scheduler, runner)
    return EngineParts(config, compile_cache_dir, mesh, loaded, grid, block_manager, scheduler, runner,
                       make_proposer(config, grid, draft, mesh),
                       kv_event_publisher(config.kv_events_config, block_manager, config.data_parallel_rank))


def warm_up_engine(parts: EngineParts, num_threads: int) -> WarmUpReport:
    """Compiles (or loads from the compile cache) the bucket executables, the samplers' and the fork programs
    (a draft model's buckets too). With ``background_compile`` only the covering set is built here and the other
    buckets in `parts.background`, started last."""
    grid, runner, config = parts.grid, parts.runner.model, parts.config
    logger.info("%s", grid.format_table())
    check = manifest = None
    cache_dir = use_persistent_cache(parts.compile_cache_dir)  # again: another engine may have moved it
    if cache_dir is not None:
        manifest = CacheManifest.current(
            parts.model.config, config.dtype, grid, runner.backend.name, parts.mesh.size,
            max_logprobs=config.max_logprobs, kv_cache_dtype=config.kv_cache_dtype,
            model=str(parts.model.path), written_by="engine warm-up",
        )
        check = use_compile_cache(runner, cache_dir, manifest)
    runner.compile_helpers()
    first = grid.covering_buckets() if _compiles_in_background(config) else grid.buckets
    report = compile_buckets(runner, first, num_threads=num_threads, cache_dir=cache_dir, cache_check=check)
    unrecorded = manifest if check is not None and not check.ok else None  # the cache lacks this configuration
    built = set(first)
    rest = [b for b in grid.buckets if b not in built]
    if rest:
        grid.serve_only(first)
        on_done = _grid_done(cache_dir, unrecorded, len(grid.buckets))
        parts.background = BackgroundCompiler(lambda bucket: compile_bucket(runner, bucket), rest, grid=grid,
                                              on_done=on_done)
        grid.on_miss = parts.background.wanted
        logger.info("warm-up: %s; serving on this covering set while %d more build in the background",
                    report.summary(), len(rest))
    else:
        logger.info("warm-up: %s", report.summary())
        if unrecorded is not None:
            record_manifest(cache_dir, unrecorded)  # every bucket of this configuration is in the cache now
    if isinstance(parts.proposer, DraftModelProposer):
        draft_report = compile_buckets(parts.proposer.runner, parts.proposer.buckets, num_threads=num_threads,
                                       cache_dir=cache_dir)
        logger.info("warm-up of the draft model: %s", draft_report.summary())
    if rest:
        parts.background.start()
    return report


def _compiles_in_background(config: EngineConfig) -> bool:
    """Whether warm-up builds only the covering set: asked for, and one host (every host of a multi-host engine runs
    each step's executable, so all of them build the whole grid before serving)."""
    if config.background_compile and jax.process_count() > 1:
        logger.info("background compilation: off on a multi-host engine (every host builds the whole grid first)")
        return False
    return config.background_compile


def _grid_done(cache_dir: Path | None, manifest: CacheManifest | None, num_buckets: int):
    """What runs once every bucket is built: the log line, and the manifest recorded for a compile cache that did
    not have it (every bucket of this configuration is in the cache now)."""
    def done(seconds: float) -> None:
        if manifest is not None:
            record_manifest(cache_dir, manifest)
        logger.info("bucket grid complete: %d buckets, the last built %.1fs after the covering set", num_buckets,
                    seconds)
    return done


def _learn_step_costs(config: EngineConfig, grid: BucketGrid, scheduler: Scheduler, runner: StepRunner) -> None:
    """With a latency target: the scheduler's step budget follows costs that the step runner's timer learns from
    the mixed steps served (nothing is timed at start-up: a busy start would freeze wrong costs)."""
    if config.max_itl_ms is None or not grid.has_mixed:
        return
    costs = StepCosts()
    scheduler.step_budget = StepBudget(grid, scheduler.max_num_batched_tokens, config.max_itl_ms, costs)
    runner.learn_step_costs(costs, grid)
    logger.info("step budget: %s", scheduler.step_budget.describe())


def kv_event_publisher(events: KVEventsConfig | None, block_manager: BlockManager,
                       rank: int) -> KVEventPublisher | None:
    """The publisher of the prefix cache's events (`kv_events_config`), the block manager recording them."""
    if events is None or not events.publishes or jax.process_index() != 0:
        return None  # multi-host: host 0 schedules, so only its block manager has events
    if block_manager.prefix_cache is None:
        logger.warning("kv_events_config: prefix caching is off, so no KV cache events will be published")
    block_manager.cache_events = []
    publisher = KVEventPublisher(events.for_rank(rank), data_parallel_rank=rank)
    how = "published at" if binds(events.endpoint) else "sent to a subscriber that binds"
    logger.info("KV cache events: %s %s (topic %r)", how, publisher.endpoint(), events.topic)
    return publisher


def make_proposer(config: EngineConfig, grid, draft: LoadedModel | None, mesh) -> Proposer | None:
    """The engine's draft proposer (None: no speculative decoding); the grid must have mixed buckets to verify in.
    ``draft``: the draft model of method "draft_model"."""
    spec = config.speculative_config
    if spec is None:
        return None
    if not grid.has_mixed:
        raise ValueError(f"speculative decoding verifies drafts in mixed steps: {grid.spec.source} has no [mixed] "
                         "buckets")
    logger.info("speculative decoding: %s%s, up to %d drafts per row, while at most %d sequences decode", spec.method,
                f" ({spec.model})" if spec.model else "", spec.num_speculative_tokens, spec.disable_by_batch_size)
    if spec.method == "draft_model":
        return build_draft_proposer(draft, config, grid, mesh)
    if spec.method == "suffix":
        return SuffixProposer(spec.num_speculative_tokens, spec.suffix_decoding_max_tree_depth,
                              spec.suffix_decoding_max_cached_requests, spec.suffix_decoding_max_spec_factor,
                              spec.suffix_decoding_min_token_prob)
    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)


def resolve_async_scheduling(requested: bool | None, platform: str, *, speculative: bool = False) -> bool:
    """Whether steps are planned ahead: as requested, else (None) on where a device runs the steps beside the
    host (TPU, GPU) and off on CPU, as vLLM's CPU backend. On CPU the host's planning takes the cores the step
    runs on, so planning ahead saves nothing, and a request arriving during step N would wait for step N+1,
    already planned without it (docs/benchmarks/serving-load.md measures both). With speculative decoding only
    steps past ``disable_by_batch_size`` are planned ahead: drafts come from the last step's tokens
    (`LLMEngine._plans_ahead`)."""
    resolved = platform != "cpu" if requested is None else requested
    logger.info("async scheduling: %s%s%s", "on" if resolved else "off", " (auto)" if requested is None else "",
                " while no sequence drafts (speculative decoding)" if resolved and speculative else "")
    return resolved


def _scheduling_summary(scheduler: Scheduler) -> str:
    """The start-up line that says how steps are formed and their token budget."""
    grid = scheduler.bucket_grid
    if not grid.has_mixed:
        return (f"scheduling: prefill-or-decode steps (no [mixed] buckets in {grid.spec.source}), "
                f"max_num_batched_tokens={scheduler.max_num_batched_tokens}")
    return (f"scheduling: mixed steps (decode rows first, then prefill chunks) of up to "
            f"{scheduler.step_budget.untargeted_tokens} tokens and {grid.max_mixed_batch_size} rows; prefill-only "
            f"steps up to max_num_batched_tokens={scheduler.max_num_batched_tokens}")
