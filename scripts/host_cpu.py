"""The machine a CPU figure was measured on, for the bench scripts' headers: the processor's model name, its bfloat16
units (`../shared/notes/cpu-bf16.md`: without one, `dtype="auto"` is float32 and every step 2-4x slower) and the CPUs
this process may use. Standard library only."""

from __future__ import annotations

import os
from pathlib import Path

BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_name() -> str:
    """e.g. "AMD EPYC (avx512_bf16), 2 CPUs", from /proc/cpuinfo ("unknown CPU" where it cannot be read)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    lines = info.splitlines()
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    bf16 = [flag for flag in BF16_FLAGS if flag in flags]
    return f"{name} ({', '.join(bf16) if bf16 else 'no bf16 unit'}), {len(os.sched_getaffinity(0))} CPUs"
