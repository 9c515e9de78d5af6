"""How many KV blocks the pool gets on a TPU or GPU: what the device's memory holds once the weights, the
sampler state and the largest steps' own needs are counted.

Place in the data flow: `engine_bucket_grid` (engine start, `jaxserve precompile`, target compiles) calls
`memory_budget` for the device's usable bytes and sizes a provisional pool from them less the weights and
the sampler state. A step needs more while it runs: temporaries (activations, attention scratch),
outputs that are not donated buffers (logits, prompt logprobs) and its code; for a 16 x 2048-token
prefill of Llama-3-8B at tensor parallel 4 that is about 2 GB per chip, more than v5e had left.
`blocks_over_budget` compiles the largest step of each kind (prefill, decode, mixed) and reads their
`memory_analysis()`; the grid then gives back as many blocks as the largest of them overshoots the
budget by. That is vLLM's profiling run, measured on the compiled executables instead of on a forward
pass. The probe compiles against a small pool (a step that does not fit cannot even be compiled for
TPU: "HLO temporaries exceed available HBM") and adds the provisional pool's remaining blocks: a step's
pool bytes are its argument (donated, updated in place), and its temporaries do not grow with the pool.
tests/compilation/test_targets.py checks the result against the final executables. On CPU the pool has a fixed
default size and nothing is probed.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxserve.runner.model_runner import ModelRunner, StepShape


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
    kind = lambda s: "mixed" if s.ragged else "decode" if s.num_query_tokens == 1 else "prefill"
    size = lambda s: (s.batch_size * s.num_query_tokens if not s.ragged else s.num_query_tokens, s.batch_size,
                      s.pages_per_seq)
    largest: dict[str, StepShape] = {}
    for shape in shapes:
        if kind(shape) not in largest or size(shape) > size(largest[kind(shape)]):
            largest[kind(shape)] = shape
    return [shape for shape in shapes if shape in largest.values()]


def blocks_over_budget(runner: ModelRunner, shapes: list[StepShape], budget: MemoryBudget, bytes_per_block: int,
                       pool_blocks: int) -> tuple[int, int]:
    """(blocks a pool of ``pool_blocks`` must give back so that the largest of ``shapes``' steps fits in ``budget``,
    the bytes that step needs with that pool). ``runner`` is abstract with a small pool of its own: a step that
    does not fit is no executable at all (the TPU compiler refuses it), so the steps are compiled against the
    small pool and the difference is added, ``bytes_per_block`` (one block's bytes per device) a block."""
    measured = max(running_bytes(runner.compile(shape)) for shape in largest_of_each_kind(shapes))
    need = measured + (pool_blocks - runner.num_blocks) * bytes_per_block
    over = need - budget.usable_bytes
    return (max(0, -(-over // bytes_per_block)), need)
