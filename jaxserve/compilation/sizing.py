"""The bucket grid and KV pool an engine runs on: its block size, limits and number of KV blocks.

Place in the data flow: `engine_bucket_grid` is called at engine start, by `jaxserve precompile` and by target
compiles, so that all of them build the same executables. It reads the bucket file, takes the engine's limits, and
sizes the KV pool: `num_kv_blocks`, or the blocks `kv_cache_memory_bytes` holds per device (vLLM's), else on CPU a
fixed default and on a TPU or GPU what the device's memory holds once the weights, the sampler state and the
largest steps' own needs are counted. `memory_budget` gives the device's usable bytes and a provisional pool is
sized from them less the weights and the sampler state. A step needs more while it runs: temporaries (activations,
attention scratch), outputs that are not donated buffers (logits) and its code; for a 16 x 2048-token prefill of
Llama-3-8B at tensor parallel 4 that is about 2 GB per chip, more than v5e had left. `blocks_over_budget` compiles
the largest step of each kind (prefill, decode, mixed), the sampler of the most rows (it runs after a step, beside
the weights and the pool, on the step's logits) and the prompt logprobs' program (beside them too), and reads
their `memory_analysis()`; the grid then gives back as many blocks as the largest of them overshoots the budget
by. That is vLLM's profiling run, measured on the compiled executables instead of on a forward pass. The probe
compiles against a small pool (a step that does not fit cannot even be compiled for TPU: "HLO temporaries exceed
available HBM") and adds the provisional pool's remaining blocks: a step's pool bytes are its argument (donated,
updated in place), and its temporaries do not grow with the pool.
tests/compilation/test_targets.py checks the result against the final executables.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from jaxserve.attention.kv_cache import kv_scale_bytes, kv_value_dtype
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.kv_cache_groups import KVCacheLayout
from jaxserve.config.model_config import ModelConfig
from jaxserve.core.buckets import BucketGrid, load_bucket_spec
from jaxserve.distributed.sharding import per_device_bytes
from jaxserve.logger import init_logger
from jaxserve.math_utils import cdiv
from jaxserve.runner.input_batch import SampleShape, StepShape, step_shape
from jaxserve.runner.model_runner import ModelRunner, sample_shapes
from jaxserve.runner.sampler_state import slot_state_bytes

logger = init_logger(__name__)


DEFAULT_CPU_KV_BLOCKS = 2048  # blocks of every layer: a model in KV cache groups gets as many bytes (`cpu_kv_blocks`)


def engine_bucket_grid(
    config: EngineConfig, model_config: ModelConfig, params, platform: str, mesh: Mesh,
    device_memory_bytes: int | None = None, *, fit_to_steps: bool = True,
    draft: tuple[ModelConfig, Any] | None = None,
) -> BucketGrid:
    """The bucket grid (with block size and KV-pool size) an engine with ``config`` runs on.

    ``params`` (arrays or ``ShapeDtypeStruct``s) only count towards the memory budget off CPU. The
    precompile command calls this too, so that it compiles exactly the engine's executables;
    ``device_memory_bytes`` is a target device's memory when compiling for hardware this host does not
    have (default: the local device's reported limit). Off CPU, unless ``num_kv_blocks`` is given, the pool
    is what the memory holds besides the weights, the sampler state and what the largest steps need while
    they run (``fit_to_steps=False`` skips that probe, for targets that only lower). ``draft``: a draft model's
    (config, params), whose weights take memory too and whose pool has as many blocks (`speculative/draft_model.py`).
    """
    spec = load_bucket_spec(config.buckets, platform)
    block_size = config.block_size or spec.block_size
    max_model_len = config.max_model_len or min(model_config.max_position_embeddings, max(spec.context_lengths))
    budget = weights_bytes = None
    models = [(model_config, params)] if draft is None else [(model_config, params), draft]
    if platform != "cpu" and config.num_kv_blocks is None and config.kv_cache_memory_bytes is None:
        weights_bytes = sum(per_device_bytes(p, mesh) for _, p in models)
        budget = memory_budget(config.gpu_memory_utilization, params, weights_bytes, device_memory_bytes)
    # the engine's pool keeps K/V as kv_cache_dtype says; a draft model's pool is in the model dtype
    kv_dtypes = [kv_value_dtype(config.kv_cache_dtype, config.dtype), config.dtype][:len(models)]
    # a block's bytes in the model's pool, and in a draft model's beside it
    target_bytes, *draft_bytes = (_block_bytes(c, block_size, kv, mesh, max_model_len)
                                  for (c, _), kv in zip(models, kv_dtypes, strict=True))
    block_bytes = target_bytes + sum(draft_bytes)
    num_slots = config.max_num_seqs or max(spec.decode_batch_sizes)
    pool_budget = None if budget is None else budget.pool_bytes(
        weights_bytes, slot_state_bytes(num_slots, model_config.vocab_size))
    # pages of several shapes: the blocks set apart for a step's chunks are sized apart from the mean block
    fixed_blocks, fixed_bytes = _in_flight(model_config, block_size, kv_dtypes[0], mesh,
                                           _max_num_batched_tokens(spec, config), sum(draft_bytes))
    less_fixed = lambda num_bytes: None if num_bytes is None else num_bytes - fixed_bytes
    num_blocks = num_blocks_from_budget(block_bytes, num_kv_blocks=config.num_kv_blocks,
                                        memory_budget_bytes=less_fixed(pool_budget),
                                        default_cpu_blocks=cpu_kv_blocks(model_config),
                                        kv_cache_memory_bytes=less_fixed(config.kv_cache_memory_bytes))
    if config.num_kv_blocks is None and (pool_budget is not None or config.kv_cache_memory_bytes is not None):
        num_blocks += fixed_blocks
    grid = _grid(spec, config, block_size, max_model_len, num_blocks)
    if budget is not None and fit_to_steps:
        over = _blocks_over_budget(grid, config, model_config, params, mesh, budget, block_bytes, draft)
        if over:
            grid = _grid(spec, config, block_size, max_model_len, num_blocks - over)
    grid.check_max_model_len(max_model_len)
    check_request_fits(grid, model_config.kv_cache_layout)
    return grid


def cpu_kv_blocks(model_config: ModelConfig) -> int:
    """The CPU pool's default size: the bytes of DEFAULT_CPU_KV_BLOCKS blocks of every layer, so a model in KV cache
    groups (a block of `layers_per_group` layers) gets as many tokens of its full-attention layers as before."""
    return DEFAULT_CPU_KV_BLOCKS * model_config.num_layers // model_config.kv_cache_layout.layers_per_group


def _block_bytes(model_config: ModelConfig, block_size: int, dtype, mesh: Mesh, max_model_len: int) -> int:
    """Bytes of one block of ``model_config``'s pool of K/V in ``dtype`` per device (the pool is split over the
    heads; a pool of latents is whole on each device), an int8 pool's scales included: a block holds the layers of
    one KV cache group. With pages of several shapes (Gemma 4), their mean over the blocks as
    `KVCacheLayout.blocks_of_kinds` shares them out."""
    demand = model_config.kv_cache_layout.kind_demand(max_model_len, block_size)
    page_bytes = _page_bytes(model_config, block_size, dtype)
    devices = _pool_split(model_config, mesh)
    return cdiv(sum(need * size for need, size in zip(demand, page_bytes, strict=True)), sum(demand) * devices)


def _pool_split(model_config: ModelConfig, mesh: Mesh) -> int:
    """Over how many devices a block's bytes split: the mesh (kv heads sharded), or none for a pool of latents
    (MLA: whole on every device, `distributed.sharding.kv_pool_sharding`)."""
    return 1 if model_config.kv_values_in_keys else mesh.size


def _page_bytes(model_config: ModelConfig, block_size: int, dtype) -> list[int]:
    """Per kind of page, the bytes of one block of it (the layers of one of its groups)."""
    layout = model_config.kv_cache_layout
    pages = 1 if model_config.kv_values_in_keys else 2  # MLA keeps its latent only
    return [kv_bytes_per_block(
        num_layers=layout.rows_of_kind(kind), num_kv_heads=num_kv_heads, block_size=block_size,
        head_dim=head_dim, dtype_bytes=jax.numpy.dtype(dtype).itemsize, scale_bytes=kv_scale_bytes(dtype),
    ) * pages // 2 for kind, (num_kv_heads, head_dim) in enumerate(model_config.kv_page_shapes)]


def _in_flight(model_config: ModelConfig, block_size: int, dtype, mesh: Mesh, max_chunk_tokens: int,
               other_block_bytes: int) -> tuple[int, int]:
    """(blocks, bytes per device) that a pool of pages of several shapes sets apart for a step's prompt chunks
    (`KVCacheLayout.blocks_of_kinds`), each block in its kind's bytes and ``other_block_bytes`` more (a draft model's
    pool); (0, 0) for pages of one shape, whose blocks are all alike."""
    layout = model_config.kv_cache_layout
    if layout.num_kinds == 1:
        return 0, 0
    flight = layout.in_flight_blocks(block_size, max_chunk_tokens)
    page_bytes = _page_bytes(model_config, block_size, dtype)
    num_bytes = sum(blocks * size for blocks, size in zip(flight, page_bytes, strict=True)) // _pool_split(
        model_config, mesh)
    return sum(flight), num_bytes + sum(flight) * other_block_bytes


def _max_num_batched_tokens(spec, config: EngineConfig) -> int:
    """The most prompt tokens of one step: the engine's limit, else the bucket file's largest prefill."""
    return config.max_num_batched_tokens or max(spec.prefill_batch_sizes) * max(spec.prefill_lengths)


def _grid(spec, config: EngineConfig, block_size: int, max_model_len: int, num_blocks: int) -> BucketGrid:
    return BucketGrid(
        spec, block_size=block_size, max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs or max(spec.decode_batch_sizes),
        max_num_batched_tokens=_max_num_batched_tokens(spec, config),
        num_blocks=num_blocks,
        # without a latency target no mixed step holds more than the spec's token_budget (core/step_budget.py)
        mixed_token_limit=spec.mixed_token_budget if config.max_itl_ms is None else None,
        speculative=config.speculative_grid,
    )


def _blocks_over_budget(grid: BucketGrid, config: EngineConfig, model_config: ModelConfig, params, mesh: Mesh,
                        budget: MemoryBudget, block_bytes: int, draft: tuple[ModelConfig, Any] | None) -> int:
    """Blocks ``grid``'s pool gives back so that its largest steps fit in ``budget`` (`blocks_over_budget`): they are
    compiled against a pool of one sequence's pages. A draft model's weights and its pool's probe-sized part are on
    the device beside them (``block_bytes`` counts both pools' blocks)."""
    shapes = list(dict.fromkeys(step_shape(b, grid.block_size) for b in grid.buckets))
    probe = ModelRunner.for_engine(model_config, params, config, grid, mesh, abstract=True,
                                   num_blocks=min(grid.num_blocks, max(s.pages_per_seq for s in shapes)))
    beside = 0
    if draft is not None:
        draft_config, draft_params = draft
        beside = per_device_bytes(draft_params, mesh) + probe.num_blocks * _block_bytes(
            draft_config, grid.block_size, config.dtype, mesh, grid.max_model_len)
    over, need = blocks_over_budget(probe, shapes, budget, block_bytes, grid.num_blocks, beside_bytes=beside)
    logger.info("KV pool: %d blocks fill the memory budget (%.0f MB per device); with them the largest step needs "
                "%.0f MB: %d blocks given back", grid.num_blocks, budget.usable_bytes / 1e6, need / 1e6, over)
    return over


def kv_cache_summary(grid: BucketGrid, layout: KVCacheLayout) -> str:
    """vLLM's two start-up lines about the KV cache: its size in tokens (each group's share of the blocks) and how
    many requests of max_model_len tokens it holds at once (`KVCacheLayout.max_concurrency`: every token in a full
    group, the window in a sliding one)."""
    pools = layout.blocks_of_kinds(grid.num_blocks, grid.max_model_len, grid.block_size, grid.max_num_batched_tokens)
    groups_of_kind = [layout.group_kinds.count(kind) for kind in range(layout.num_kinds)]
    tokens = min(blocks // groups for blocks, groups in zip(pools, groups_of_kind, strict=True)) * grid.block_size
    concurrency = layout.max_concurrency(grid.num_blocks, grid.max_model_len, grid.block_size,
                                         grid.max_num_batched_tokens)
    return (f"KV cache size: {tokens:,} tokens\n"
            f"Maximum concurrency for {grid.max_model_len:,} tokens per request: {concurrency:.2f}x")


def check_request_fits(grid: BucketGrid, layout: KVCacheLayout) -> None:
    """ValueError unless one request of max_model_len tokens fits the pool with every KV cache group's blocks."""
    needed = layout.blocks_per_request(grid.max_model_len, grid.block_size, grid.max_num_batched_tokens)
    if not layout.fits_one_request(grid.num_blocks, grid.max_model_len, grid.block_size,
                                   grid.max_num_batched_tokens, grid.max_model_len):
        raise ValueError(
            f"max_model_len {grid.max_model_len} needs up to {needed} KV cache blocks of {grid.block_size} tokens "
            f"over the model's {layout.num_groups} KV cache groups, and the pool has {grid.num_blocks}: raise "
            "num_kv_blocks (or the memory for the KV cache) or lower max_model_len")


def kv_bytes_per_block(
    *, num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype_bytes: int, scale_bytes: int = 0
) -> int:
    """Device bytes of one block across all layers: K and V, with ``scale_bytes`` per token and kv head beside
    the values (an int8 pool's scales)."""
    return 2 * num_layers * num_kv_heads * block_size * (head_dim * dtype_bytes + scale_bytes)


def num_blocks_from_budget(
    bytes_per_block: int,
    *,
    num_kv_blocks: int | None,
    memory_budget_bytes: int | None,
    default_cpu_blocks: int,
    kv_cache_memory_bytes: int | None = None,
) -> int:
    """Size of the KV pool in blocks.

    An explicit ``num_kv_blocks`` wins; else ``kv_cache_memory_bytes // bytes_per_block`` (vLLM's option: the
    pool's bytes per device); else ``memory_budget_bytes // bytes_per_block`` (GPU/TPU: the caller passes
    gpu_memory_utilization * device memory - weights - activations); else ``default_cpu_blocks``. Raises
    ValueError when the result would be zero blocks.
    """
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be >= 1, got {bytes_per_block}")
    if num_kv_blocks is not None:
        if num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_kv_blocks}")
        return num_kv_blocks
    if kv_cache_memory_bytes is not None:
        if kv_cache_memory_bytes < bytes_per_block:
            raise ValueError(f"kv_cache_memory_bytes={kv_cache_memory_bytes} holds no KV block: one needs "
                             f"{bytes_per_block} bytes per device ({bytes_per_block / 2**20:.2f} MiB)")
        return kv_cache_memory_bytes // bytes_per_block
    if memory_budget_bytes is not None:
        num_blocks = memory_budget_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"no memory left for the KV cache: the budget is {memory_budget_bytes} bytes "
                f"({memory_budget_bytes / 2**20:.1f} MiB) but one block needs {bytes_per_block} bytes "
                f"({bytes_per_block / 2**20:.1f} MiB); raise gpu_memory_utilization, use a smaller "
                "model or block_size, or set num_kv_blocks"
            )
        return num_blocks
    if default_cpu_blocks < 1:
        raise ValueError(f"default_cpu_blocks must be >= 1, got {default_cpu_blocks}")
    return default_cpu_blocks


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """Bytes per device that the engine may use (gpu_memory_utilization of the limit, less what is in use)."""

    usable_bytes: int

    def pool_bytes(self, weights_bytes: int, sampler_state_bytes: int) -> int:
        """The provisional pool's share: the budget less the weights and the sampler state."""
        return self.usable_bytes - weights_bytes - sampler_state_bytes


def memory_budget(gpu_memory_utilization: float, params, weights_bytes: int,
                  device_memory_bytes: int | None = None) -> MemoryBudget:
    """The local device's budget (its reported limit, less what is in use besides the weights), or a target
    device's of ``device_memory_bytes`` (compiling for hardware this host does not have: nothing in use).

    ``params`` already on the device count in its bytes in use: they are added back (the budget's users count
    the weights themselves, ``weights_bytes`` per device), so that they are not subtracted twice."""
    if device_memory_bytes is None:
        stats = jax.local_devices()[0].memory_stats() or {}
    else:
        stats = {"bytes_limit": device_memory_bytes, "bytes_in_use": 0}
    resident = all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))
    in_use = stats.get("bytes_in_use", 0) - (weights_bytes if resident and device_memory_bytes is None else 0)
    return MemoryBudget(int(stats.get("bytes_limit", 0) * gpu_memory_utilization - max(in_use, 0)))


def running_bytes(compiled: jax.stages.Compiled) -> int:
    """Device memory while a compiled program runs: arguments, outputs not aliased to (donated) arguments,
    temporaries and code."""
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
            + m.generated_code_size_in_bytes)


def largest_of_each_kind(shapes: list[StepShape]) -> list[StepShape]:
    """The largest step (query tokens, then pages) of each kind: prefill, decode and mixed (ragged)."""
    size = lambda s: (s.num_tokens, s.batch_size, s.pages_per_seq)
    largest: dict[str, StepShape] = {}
    for shape in shapes:
        if shape.kind not in largest or size(shape) > size(largest[shape.kind]):
            largest[shape.kind] = shape
    return [shape for shape in shapes if shape in largest.values()]


def largest_samplers(shapes: list[StepShape]) -> list[SampleShape]:
    """The sampler of the most logits rows of each kind: a plain step's (its batch size) and a verifying step's
    (its sample positions)."""
    rows = lambda s: (s.num_sample_positions or s.batch_size, s.batch_size)
    largest: dict[bool, SampleShape] = {}
    for shape in sample_shapes(shapes):
        verifying = bool(shape.num_sample_positions)
        if verifying not in largest or rows(shape) > rows(largest[verifying]):
            largest[verifying] = shape
    return list(largest.values())


def _prompt_logprobs_bytes(runner: ModelRunner) -> int:
    """Bytes on the device while the prompt logprobs' program runs: everything resident (its arguments, the weights
    and the positions, among them) and its own outputs, temporaries and code."""
    if runner.prompt_positions is None:
        return 0
    compiled = runner.compile_prompt_logprobs()
    return running_bytes(compiled) - compiled.memory_analysis().argument_size_in_bytes + runner.resident_bytes()


def blocks_over_budget(runner: ModelRunner, shapes: list[StepShape], budget: MemoryBudget, bytes_per_block: int,
                       pool_blocks: int, *, beside_bytes: int = 0) -> tuple[int, int]:
    """(blocks a pool of ``pool_blocks`` must give back so that the largest of ``shapes``' steps and samplers fits
    in ``budget``, the bytes it needs with that pool). ``runner`` is abstract with a small pool of its own: a step
    that does not fit is no executable at all (the TPU compiler refuses it), so the steps are compiled against the
    small pool and the difference is added, ``bytes_per_block`` (one block's bytes per device) a block. A sampler
    runs beside the weights and the pool, which are not its arguments: they are added to its own bytes; so are
    ``beside_bytes`` to every program's (a draft model's weights and pool, resident while the target's steps run)."""
    steps = max(running_bytes(runner.compile(shape)) for shape in largest_of_each_kind(shapes))
    samplers = max(running_bytes(runner.compile_sampler(shape)) for shape in largest_samplers(shapes))
    measured = max(steps, samplers + runner.resident_bytes(), _prompt_logprobs_bytes(runner)) + beside_bytes
    need = measured + (pool_blocks - runner.num_blocks) * bytes_per_block
    over = need - budget.usable_bytes
    return (max(0, cdiv(over, bytes_per_block)), need)
