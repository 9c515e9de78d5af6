"""The engine's dtype: `dtype="auto"` resolved for the platform, as vLLM's default does.

Place in the data flow: `LLMEngine` and `jaxserve precompile` resolve `EngineConfig.dtype` here before
anything is loaded or compiled, and log the choice with its reason. "bfloat16" is the mixed-precision
policy of `jaxserve.models.common` (weights and KV pool in bfloat16, bf16 x bf16 matmuls accumulating in
float32, everything else float32); "float32" is float32 throughout. "auto" picks bfloat16 where the
device has a bfloat16 matrix unit (TPU; NVIDIA GPUs of compute capability 8.0 and later; CPUs with
AMX-BF16 or AVX512-BF16), float32 elsewhere.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxserve.config.engine_config import EngineConfig
from jaxserve.logger import init_logger

logger = init_logger("jaxserve.precision")

GPU_PLATFORMS = ("gpu", "cuda", "rocm")  # JAX's platform names of NVIDIA and AMD GPUs (as kernels_pallas._common's)

CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo names, the matrix unit first


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The feature flags of the first processor in /proc/cpuinfo (or in the given text); empty if unreadable."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def bf16_matrix_unit(device, flags: frozenset[str] | None = None) -> str | None:
    """What runs bf16 matmuls natively on ``device`` (a jax Device), or None if nothing does."""
    platform = device.platform
    if platform == "tpu":
        return "TPU MXU"
    if platform in ("gpu", "cuda"):
        capability = getattr(device, "compute_capability", None)
        if capability is not None and float(capability) >= 8.0:
            return f"GPU tensor cores (compute capability {capability})"
        return None
    if platform == "cpu":
        flags = cpu_flags() if flags is None else flags
        found = [flag for flag in CPU_BF16_FLAGS if flag in flags]
        return f"CPU with {' and '.join(found)}" if found else None
    return None


def resolve_dtype(dtype: str, device, flags: frozenset[str] | None = None) -> tuple[str, str]:
    """(the concrete dtype, why): "auto" becomes bfloat16 where ``device`` has a bf16 matrix unit."""
    if dtype != "auto":
        return dtype, "as requested"
    unit = bf16_matrix_unit(device, flags)
    if unit is not None:
        return "bfloat16", f"dtype=auto: {unit} runs bfloat16 matmuls (float32 accumulation)"
    return "float32", f"dtype=auto: no bfloat16 matrix unit on this {device.platform} device"


def resolve_engine_dtype(config: EngineConfig, device) -> EngineConfig:
    """``config`` with its dtype resolved for ``device`` (the first device of the engine's mesh), logged."""
    dtype, reason = resolve_dtype(config.dtype, device)
    logger.info("dtype %s (%s)", dtype, reason)
    return dataclasses.replace(config, dtype=dtype)
