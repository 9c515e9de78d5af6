"""jaxserve: an LLM inference and serving engine in JAX/XLA.

The public API mirrors vLLM: `LLM` for offline generation, `SamplingParams`, `RequestOutput`, and
`AsyncLLMEngine` for servers. Imports are lazy so that `import jaxserve` stays cheap.
"""

from __future__ import annotations

import importlib

from jaxserve.compilation.targets import quiet_libtpu_without_tpu

__version__ = "0.1.0"

quiet_libtpu_without_tpu()  # before JAX starts: no libtpu start-up errors on hosts without a TPU

_EXPORTS = {
    "LLM": "jaxserve.llm",
    "SamplingParams": "jaxserve.sampling_params",
    "BeamSearchParams": "jaxserve.sampling_params",
    "RequestOutputKind": "jaxserve.sampling_params",
    "StructuredOutputsParams": "jaxserve.sampling_params",
    "RequestOutput": "jaxserve.outputs",
    "CompletionOutput": "jaxserve.outputs",
    "Logprob": "jaxserve.outputs",
    "BeamSearchOutput": "jaxserve.outputs",
    "BeamSearchSequence": "jaxserve.outputs",
    "LLMEngine": "jaxserve.engine.llm_engine",
    "AsyncLLMEngine": "jaxserve.engine.async_engine",
    "EngineConfig": "jaxserve.config.engine_config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
