"""The XLA options each of the runner's programs is compiled with (`ModelRunner._compile`): by the platform it is
built for and the dtype it computes in.

XLA:CPU has two code generators for its fusions: the MLIR fusion emitters (its default) and the LLVM IR emitters
before them (``xla_cpu_use_fusion_emitters=False``). On a 2-core AMD EPYC (docs/benchmarks/startup.md) the older
ones compiled the embedded model's float32 programs 1.3-1.7x faster (a decode step 0.54 -> 0.32 s, a mixed step
0.76 -> 0.55 s, the 64-row sampler 1.50 -> 1.18 s) and they ran as fast; its bfloat16 steps compiled 2x slower with
them. So a program that computes in float32 on CPU (every sampler, and the steps of a float32 engine) gets the
older emitters and every other CPU program the newer ones, both named explicitly (so ``XLA_FLAGS`` choosing either
for a process, as the test suite does, changes neither); TPU and GPU programs get no options.

The LLVM IR emitters put a program's kernels into ``xla_cpu_parallel_codegen_split_count`` LLVM modules (32 by
default) and compile each apart, at a near-fixed cost per module: in 4 modules a float32 step compiled in 6-20% less
wall time and 10-25% less CPU on 2 cores (medians of 8 interleaved rounds: decode 0.28 -> 0.25 s, prefill 0.40 ->
0.32, mixed 0.36 -> 0.34; the sampler and the fusion emitters' bfloat16 steps unchanged; docs/benchmarks/startup.md).
A fixed number, not the machine's cores, so that a compile cache built on one machine serves another (the options
are part of JAX's cache key).

XLA:GPU's dot merger joins two products that share an input into one, by concatenating their other operands: in a
model those are weights (gate and up, q/k/v), so every step copied them into one array first; on an H200 a
Llama-3.2-1B prefill step spent a tenth of its time in that copy (docs/benchmarks/gpu.md). GPU programs turn it
off; TPU programs get no options.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxserve.precision import GPU_PLATFORMS

CODEGEN_MODULES = 4  # LLVM modules per program under the LLVM IR emitters (XLA's default: 32)
LLVM_IR_EMITTERS = {"xla_cpu_use_fusion_emitters": False, "xla_cpu_parallel_codegen_split_count": CODEGEN_MODULES}
FUSION_EMITTERS = {"xla_cpu_use_fusion_emitters": True}
GPU_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}  # never concatenate weights to merge two products


def compiler_options(platform: str, compute_dtype) -> dict[str, bool | int] | None:
    """Options for ``jax.stages.Lowered.compile`` of a program built for ``platform`` that computes in
    ``compute_dtype``; None for XLA's defaults."""
    if platform in GPU_PLATFORMS:
        return dict(GPU_OPTIONS)
    if platform != "cpu":
        return None
    return dict(LLVM_IR_EMITTERS if jnp.dtype(compute_dtype) == jnp.float32 else FUSION_EMITTERS)
