"""The engine's options: `EngineConfig`, everything `LLM(...)` and `jaxserve serve` take, with vLLM's names.

Place in the data flow: the command line (`jaxserve.entrypoints.args`) and `LLM(...)` build an `EngineConfig`;
every option is checked here, where it is given, and the nested options are parsed into their configs
(`speculative_config.py`, `kv_events_config.py`, `structured_outputs_config.py`, the schemes of
`quantization_config.py`). The engine then derives what is left as None (the grid, the KV pool:
`jaxserve.compilation.sizing`) and resolves `dtype="auto"` (`jaxserve.precision`).
"""

from __future__ import annotations

import dataclasses
import os

from jaxserve.config.kv_events_config import KVEventsConfig
from jaxserve.config.mla_config import latent_row_width
from jaxserve.config.model_config import ModelConfig
from jaxserve.config.quantization_config import KV_CACHE_DTYPE_CHOICES, parse_quantization
from jaxserve.config.speculative_config import SpeculativeConfig
from jaxserve.config.structured_outputs_config import StructuredOutputsConfig

SUPPORTED_DTYPES = ("float32", "bfloat16")  # what weights and the KV pool are stored in
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy values
DTYPE_CHOICES = ("auto", *SUPPORTED_DTYPES)  # "auto": bfloat16 where a bf16 matrix unit exists (precision.py)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything `LLM(...)` and `jaxserve serve` take, with vLLM's names.

    `None` means "derive": `max_model_len` from the model and the largest context bucket,
    `max_num_seqs` from the largest decode bucket, `max_num_batched_tokens` from the largest prefill
    bucket, `block_size` from the bucket file, and `num_kv_blocks` from the memory budget.
    `tensor_parallel_size` devices (of all hosts, after `distributed_init`) hold one engine, its weights and
    KV pool split by attention heads (see `jaxserve.distributed.sharding` and `jaxserve.distributed.multihost`).
    `compile_cache_dir` is JAX's persistent compilation cache, where warm-up loads and stores executables:
    None (the default) is ``$JAXSERVE_COMPILE_CACHE_DIR`` if set (empty: disabled), else the per-user
    ``~/.cache/jaxserve/compile_cache``; a path overrides; ``""`` disables it. The value is kept as given and
    resolved when the engine starts (`jaxserve.compilation.compile_cache.resolve_cache_dir`).
    `strict_no_compile` turns a compilation after warm-up into a RuntimeError (vLLM TPU's check), on the step's
    thread: with `background_compile` (the server's default) warm-up builds only the covering set of buckets, the
    engine serves on it at once, and a thread builds the others, each used from the step after it lands
    (`compilation/background.py`).
    """

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    num_kv_blocks: int | None = None
    # vLLM's: the KV cache's bytes per device, instead of the share of memory left (no probe of the steps' needs)
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # vLLM's: every layer keeps every token, sliding-window layers too (no KV cache groups, `config/kv_cache_groups.py`)
    disable_hybrid_kv_cache_manager: bool = False
    buckets: str | None = None
    seed: int = 0
    attention_backend: str = "auto"
    waiting_served_ratio: float | None = None
    scheduling_policy: str = "fcfs"  # vLLM's: "fcfs" (arrival order) or "priority" (requests' priority, then arrival)
    async_scheduling: bool | None = None  # schedule step N+1 while step N runs; None: on TPU/GPU, off on CPU
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # engine replicas behind one server (engine_core/data_parallel.py)
    data_parallel_rank: int = 0  # this engine's replica: its devices and its KV events' port offset
    distributed_init: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    compile_cache_dir: str | None = None  # None: the per-user default; "": disabled (compilation/compile_cache.py)
    strict_no_compile: bool = False  # raise if anything compiles after warm-up
    # warm-up builds the covering set only and the other buckets in a thread while serving (the server's default)
    background_compile: bool = False
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for (vLLM's default)
    enable_prefix_caching: bool = True  # reuse cached KV blocks of repeated prompt prefixes (vLLM's default)
    disable_log_stats: bool = False  # no periodic stats line (throughput, queues, KV usage, prefix hit rate)
    max_itl_ms: float | None = None  # latency target of steps with decode rows (core/step_budget.py); None: none
    # speculative decoding (vLLM's dict, or its JSON: `SpeculativeConfig`); None: off
    speculative_config: SpeculativeConfig | dict | str | None = None
    # KV cache events for KV-aware routers (vLLM's dict, or its JSON: `KVEventsConfig`); None: none published
    kv_events_config: KVEventsConfig | dict | str | None = None
    # how structured outputs are enforced (vLLM's dict, or its JSON: `StructuredOutputsConfig`); None: its defaults
    structured_outputs_config: StructuredOutputsConfig | dict | str | None = None
    # weights quantized at load: "int8", "int8_w8a8" or "fp8"; "gguf": a GGUF file's blocks kept (jaxserve.quantization)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8": float8 e4m3; "int8": scaled int8 (kv_cache.py)

    def __post_init__(self) -> None:
        """Each check in the order of the options' roles; the first bad value raises a ValueError naming it."""
        self._check_dtype()
        self._check_parallelism()
        self._check_grid_sizes()
        self._check_limits()
        self._check_compile_cache_dir()
        self._check_switches()
        self._parse_nested_configs()
        self._check_storage_formats()
        self._check_async_scheduling()

    def _check_dtype(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {', '.join(DTYPE_CHOICES)}")

    def _check_parallelism(self) -> None:
        """The tensor- and data-parallel sizes (positive integers, not bools) and this replica's rank among them."""
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.data_parallel_rank, int) or not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, {self.data_parallel_size}) "
                             f"(data_parallel_size), got {self.data_parallel_rank!r}")

    def _check_grid_sizes(self) -> None:
        """The grid and pool sizes: None (derived) or a positive integer."""
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
                     "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_kv_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory_bytes, not both: each sets the KV pool's size")

    def _check_limits(self) -> None:
        """The per-request logprobs limit, the latency target and the memory share."""
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be a non-negative integer, got {self.max_logprobs!r}")
        if self.max_itl_ms is not None and (isinstance(self.max_itl_ms, bool) or not self.max_itl_ms > 0):
            raise ValueError(f"max_itl_ms must be a positive number of milliseconds, got {self.max_itl_ms!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def _check_compile_cache_dir(self) -> None:
        """None (the default directory), "" (no persistent cache) or a path, kept as a string."""
        if self.compile_cache_dir is None:
            return
        if not isinstance(self.compile_cache_dir, str | os.PathLike):
            raise ValueError(f"compile_cache_dir must be a directory path, got {self.compile_cache_dir!r}")
        object.__setattr__(self, "compile_cache_dir", os.fspath(self.compile_cache_dir))

    def _check_switches(self) -> None:
        for name in ("strict_no_compile", "background_compile", "enable_prefix_caching", "disable_log_stats",
                     "disable_hybrid_kv_cache_manager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                             f"{self.scheduling_policy!r}")

    def _parse_nested_configs(self) -> None:
        """`speculative_config` and `kv_events_config` as their configs (from a dict or a JSON object), or None;
        `structured_outputs_config` as its config (None: the defaults)."""
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        object.__setattr__(self, "structured_outputs_config",
                           StructuredOutputsConfig.parse(self.structured_outputs_config))

    def _check_storage_formats(self) -> None:
        """The quantization scheme of the weights and the KV cache's dtype."""
        parse_quantization(self.quantization)  # a ValueError naming the schemes
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"unsupported kv_cache_dtype {self.kv_cache_dtype!r}; supported: "
                             f"{', '.join(KV_CACHE_DTYPE_CHOICES)}")

    def _check_async_scheduling(self) -> None:
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True, False or None (auto), got {self.async_scheduling!r}")

    def kv_cache_model_config(self, model_config: ModelConfig, platform: str) -> ModelConfig:
        """``model_config`` with the KV cache this engine keeps on ``platform``: sliding-window layers in groups of
        their own (`config/kv_cache_groups.py`) unless `disable_hybrid_kv_cache_manager`, or a draft model's pool
        follows the first group's block tables and the model has no full-attention layer to give that group every
        token; a pool of latents (MLA) in rows of the platform's width (`mla_config.latent_row_width`)."""
        spec = self.speculative_config
        draft_follows = spec is not None and spec.method == "draft_model" and all(model_config.sliding_layers)
        hybrid = not (self.disable_hybrid_kv_cache_manager or draft_follows)
        model_config = dataclasses.replace(model_config, hybrid_kv_cache=hybrid)
        if model_config.mla is None:
            return model_config
        return dataclasses.replace(model_config, head_dim=latent_row_width(model_config.mla.latent_dim, platform))

    @property
    def speculative_grid(self) -> tuple[int, int] | None:
        """(most drafts per row, most rows with drafts) that the mixed buckets make room for; None: no speculation."""
        spec = self.speculative_config
        return None if spec is None else (spec.num_speculative_tokens, spec.disable_by_batch_size)
