"""Frozen configuration dataclasses, one module per topic; the lowest layer, imported by everything above.

Where each topic lives (modules of this repository import from these, the package re-exports them for users):

- `model_config.py`: `ModelConfig`, the network a checkpoint holds, read from a Hugging Face `config.json`;
  the supported architectures and the family tuples.
- `rope_config.py`: `RopeConfig`, a model's rotary embeddings and their scaling.
- `kv_cache_groups.py`: `KVCacheLayout`, a model's layers in KV cache groups (which block table and pool row each
  layer uses), and how many blocks a request holds in them.
- `quantization_config.py`: `QuantScheme` and `parse_quantization` (the quantization schemes), the KV cache
  dtypes, `has_fp8_matrix_unit` (which platforms multiply float8).
- `engine_config.py`: `EngineConfig`, every option `LLM(...)` and `jaxserve serve` take; the `dtype` choices.
- `speculative_config.py`: `SpeculativeConfig`, vLLM's `speculative_config`.
- `kv_events_config.py`: `KVEventsConfig`, vLLM's `kv_events_config`.
- `structured_outputs_config.py`: `StructuredOutputsConfig`, vLLM's `structured_outputs_config`.
- `dict_options.py`: the dict-valued options read from a dict or a JSON object.

No module here imports JAX at import time (`jaxserve.core` imports them without JAX).
"""

from __future__ import annotations

from jaxserve.config.engine_config import DTYPE_CHOICES, SUPPORTED_DTYPES, EngineConfig
from jaxserve.config.kv_events_config import KVEventsConfig
from jaxserve.config.model_config import (
    GEMMA_FAMILIES,
    LEARNED_POSITION_FAMILIES,
    MOE_FAMILIES,
    QK_NORM_FAMILIES,
    SUPPORTED_ACTIVATIONS,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
)
from jaxserve.config.quantization_config import (
    FP8_E4M3_MAX,
    GGUF_GROUP_SIZE,
    INT8_MAX,
    KV_CACHE_DTYPE_CHOICES,
    KV_SCALE_NAMES,
    QUANTIZATION_CHOICES,
    QuantScheme,
    has_fp8_matrix_unit,
    parse_quantization,
)
from jaxserve.config.rope_config import (
    CONTEXT_EXTENSION_ROPE_TYPES,
    ROPE_FACTOR_FIELDS,
    ROPE_TYPE_ALIASES,
    SLIDING_LAYER,
    SUPPORTED_ROPE_TYPES,
    RopeConfig,
)
from jaxserve.config.speculative_config import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    DEFAULT_PROMPT_LOOKUP,
    KNOWN_KEYS,
    METHOD_KEYS,
    METHODS,
    SUFFIX_DEFAULTS,
    UNSUPPORTED_METHODS,
    SpeculativeConfig,
)
from jaxserve.config.structured_outputs_config import StructuredOutputsConfig

__all__ = [
    # engine_config
    "EngineConfig", "DTYPE_CHOICES", "SUPPORTED_DTYPES",
    # model_config
    "ModelConfig", "SUPPORTED_ARCHITECTURES", "LEARNED_POSITION_FAMILIES", "GEMMA_FAMILIES", "QK_NORM_FAMILIES",
    "MOE_FAMILIES", "SUPPORTED_ACTIVATIONS",
    # rope_config
    "RopeConfig", "SLIDING_LAYER", "SUPPORTED_ROPE_TYPES", "ROPE_TYPE_ALIASES", "CONTEXT_EXTENSION_ROPE_TYPES",
    "ROPE_FACTOR_FIELDS",
    # quantization_config
    "QuantScheme", "parse_quantization", "has_fp8_matrix_unit", "QUANTIZATION_CHOICES", "GGUF_GROUP_SIZE",
    "KV_CACHE_DTYPE_CHOICES", "KV_SCALE_NAMES", "INT8_MAX", "FP8_E4M3_MAX",
    # speculative_config
    "SpeculativeConfig", "METHODS", "UNSUPPORTED_METHODS", "DEFAULT_PROMPT_LOOKUP", "DEFAULT_DISABLE_BY_BATCH_SIZE",
    "SUFFIX_DEFAULTS", "METHOD_KEYS", "KNOWN_KEYS",
    # kv_events_config
    "KVEventsConfig",
    # structured_outputs_config
    "StructuredOutputsConfig",
]
