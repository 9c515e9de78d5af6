"""Reads a `jax.profiler` trace and sums its device kernels: the table behind docs/benchmarks/gpu.md's profiles.

`traced(fn, iters, log_dir)` runs `fn` (which blocks on its own result) `iters` times inside one trace session and
returns the trace file; `device_kernels(path)` lists its device kernels (a GPU plane's streams; on a CPU host, XLA's
ops of the host plane, so the code runs here too); `summarise(kernels, iters, wall_s)` gives per iteration: the
kernels' count, the sum of their durations, the time the device was busy (the union of their intervals) and the
wall time not covered by it (launch gaps and host work), and the kernels grouped by name and by kind (attention,
matrix products, copies, sort, other fusions). `format_summary` writes it as markdown.

    from gpu_trace import traced, device_kernels, summarise, format_summary
    path = traced(lambda: step().block_until_ready(), 5, "/tmp/trace/decode16")
    print(format_summary("decode 16", summarise(device_kernels(path), 5, wall_s=3.6e-3)))
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from pathlib import Path

KINDS = (  # (kind, pattern over a kernel's name and its HLO op), first match wins
    ("attention", re.compile(r"paged_attention|ragged|prefill_attention|mla_decode|flash|fmha", re.I)),
    ("matmul", re.compile(r"gemm|cublas|cutlass|xmma|nvjet|sm90_|sm80_|matmul|__triton_gemm|dot", re.I)),
    ("sort/top-k", re.compile(r"sort|topk|top_k|radix|cub::", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|dynamic.update.slice|dynamic.slice|scatter|gather", re.I)),
)


DERIVED_LINES = {"XLA Modules", "XLA Ops", "Steps", "XLA TraceMe", "Framework Ops", "Framework Name Scope",
                 "Source code", "Launch Stats", "TensorFlow Name Scope", "TensorFlow Ops"}


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    start_ns: float
    duration_ns: float
    module: str  # the HLO module (the jitted program) it ran for, "" where the trace does not say
    op: str  # the HLO op, "" where the trace does not say

    @property
    def kind(self) -> str:
        text = f"{self.name} {self.op}"
        return next((kind for kind, pattern in KINDS if pattern.search(text)), "other fusion")


def traced(fn, iters: int, log_dir: str | Path) -> Path:
    """Runs ``fn()`` ``iters`` times inside one `jax.profiler.trace` to ``log_dir``; the trace file it wrote."""
    import jax

    with jax.profiler.trace(str(log_dir)):
        for _ in range(iters):
            fn()
    return max(Path(log_dir).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)


def device_kernels(path: str | Path) -> list[Kernel]:
    """The device kernels of a trace file, by start time: every event of a GPU plane's lines (streams), or on a
    CPU host the events of the host plane that carry an HLO op."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(path))
    gpu_planes = [plane for plane in data.planes if plane.name.startswith("/device:GPU")]
    kernels = []
    for plane in gpu_planes or [p for p in data.planes if p.name.startswith("/host:CPU")]:
        for line in plane.lines:
            if gpu_planes and line.name in DERIVED_LINES:
                continue  # they repeat the streams' kernels
            for event in line.events:
                stats = {name: value for name, value in event.stats}
                if event.duration_ns <= 0 or (not gpu_planes and "hlo_op" not in stats):
                    continue
                kernels.append(Kernel(event.name, event.start_ns, event.duration_ns,
                                      str(stats.get("hlo_module", "")), str(stats.get("hlo_op", ""))))
    return sorted(kernels, key=lambda k: k.start_ns)


def busy_ns(kernels: list[Kernel]) -> float:
    """Length of the union of the kernels' intervals (streams overlapping count once)."""
    total, end = 0.0, float("-inf")
    for k in kernels:  # sorted by start
        stop = k.start_ns + k.duration_ns
        if stop > end:
            total += stop - max(k.start_ns, end)
            end = stop
    return total


def summarise(kernels: list[Kernel], iters: int, wall_s: float | None = None, top: int = 12) -> dict:
    """Per-iteration figures of a trace of ``iters`` runs (microseconds); ``wall_s``: one run's wall time measured
    outside the trace, to set the device's busy time against."""
    by_name, by_kind, by_module = defaultdict(lambda: [0, 0.0]), defaultdict(float), defaultdict(float)
    for k in kernels:
        entry = by_name[(k.kind, k.name[:90])]
        entry[0] += 1
        entry[1] += k.duration_ns
        by_kind[k.kind] += k.duration_ns
        by_module[k.module] += k.duration_ns
    per_iter = lambda ns: ns / iters / 1e3
    busy = per_iter(busy_ns(kernels))
    summary = {
        "kernels": len(kernels) / iters,
        "kernel_us": per_iter(sum(k.duration_ns for k in kernels)),
        "busy_us": busy,
        "wall_us": None if wall_s is None else wall_s * 1e6,
        "idle_us": None if wall_s is None else wall_s * 1e6 - busy,
        "by_kind": {kind: per_iter(ns) for kind, ns in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "by_module": {module: per_iter(ns) for module, ns in sorted(by_module.items(), key=lambda kv: -kv[1])},
        "top": [
            {"kind": kind, "name": name, "count": count / iters, "us": per_iter(ns), "mean_us": ns / count / 1e3}
            for (kind, name), (count, ns) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
        ],
    }
    return summary


def format_summary(label: str, s: dict) -> str:
    wall = "" if s["wall_us"] is None else f", wall {s['wall_us']:.1f} us, not busy {s['idle_us']:.1f} us"
    lines = [
        f"### {label}: {s['kernels']:.0f} kernels, {s['kernel_us']:.1f} us of kernels, device busy {s['busy_us']:.1f} "
        f"us{wall} (per run)",
        "kinds: " + ", ".join(f"{kind} {us:.1f}" for kind, us in s["by_kind"].items()),
        "modules: " + ", ".join(f"{module or '?'} {us:.1f}" for module, us in s["by_module"].items()),
        "",
        "| kind | kernel | per run | us per run | us each |",
        "|---|---|---:|---:|---:|",
    ]
    lines += [f"| {t['kind']} | `{t['name']}` | {t['count']:.1f} | {t['us']:.1f} | {t['mean_us']:.2f} |"
              for t in s["top"]]
    return "\n".join(lines)
