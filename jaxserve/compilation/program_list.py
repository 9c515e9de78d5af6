"""The programs an engine runs, named and counted by kind, before any of them is compiled.

Place in the data flow: `jaxserve precompile --target` (`target_compile.py`) prints this list before compiling
(and with `--list` prints it only). An engine runs one program per step shape of its grid (a prefill, decode or
mixed step), a sampler per sample shape of those steps (one per batch size: `ModelRunner.programs`), the
allocation programs of its pool, `no_tokens` and sampler state, the fork programs (`copy_blocks`, `write_slot`)
and the prompt logprobs' program; a draft model's runner adds its own steps, samplers and allocations, listed as
"draft ...".
Listing builds nothing: the names come from the shapes and the runner's abstract structs.
"""

from __future__ import annotations

import dataclasses

from jaxserve.runner.input_batch import StepShape
from jaxserve.runner.model_runner import PROMPT_LOGPROBS, ModelRunner, executable_name, sample_shapes, sampler_name

FORK_PROGRAMS = ("copy_blocks", "write_slot")


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    kind: str  # "prefill step", "decode step", "mixed step", "sampler", "allocation", "fork" or "prompt logprobs"
    # ("draft ..." too)


def runner_programs(runner: ModelRunner, shapes: list[StepShape], *, forks: bool = True,
                    prefix: str = "") -> list[Program]:
    """Every program ``runner`` runs for the steps of ``shapes``, in compile order: steps, samplers, allocations
    and (``forks``) the forks and the prompt logprobs', each name and kind after ``prefix`` ("draft " for a draft
    model's)."""
    steps = [Program(executable_name(shape), f"{shape.kind} step") for shape in shapes]
    samplers = [Program(sampler_name(shape), "sampler") for shape in sample_shapes(shapes)]
    named = {p.name for p in steps + samplers}
    helpers = [Program(name, _helper_kind(name)) for name in runner.programs([], forks=forks) if name not in named]
    return [Program(prefix + p.name, prefix + p.kind) for p in steps + samplers + helpers]


def _helper_kind(name: str) -> str:
    if name == PROMPT_LOGPROBS:
        return "prompt logprobs"
    return "fork" if name in FORK_PROGRAMS else "allocation"


def count_by_kind(programs: list[Program]) -> dict[str, int]:
    """Programs per kind, the kinds in the order they first appear."""
    counts: dict[str, int] = {}
    for p in programs:
        counts[p.kind] = counts.get(p.kind, 0) + 1
    return counts


def format_program_list(programs: list[Program], where: str) -> str:
    """The total and the count per kind, then one program a line with its kind."""
    counts = ", ".join(f"{n} {kind}{'s' if n > 1 else ''}" for kind, n in count_by_kind(programs).items())
    width = max((len(p.name) for p in programs), default=0)
    lines = [f"{len(programs)} programs {where}: {counts}"]
    lines += [f"  {p.name.ljust(width)}  {p.kind}" for p in programs]
    return "\n".join(lines)
