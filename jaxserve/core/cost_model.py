"""Mixed step costs learned from the steps the server runs (host side, no JAX): what the step budget weighs.

Place in the data flow: the step runner times each mixed step it reads back (`runner/step_costs.py`) and hands
the seconds to `StepCosts.observe` with the step's bucket shape ``(num_tokens, batch_size)``; the scheduler's
step budget (`step_budget.py`) reads `StepCosts.of` for the shapes it weighs. Nothing is timed at start-up:
until a shape is measured the budget is the untargeted one.

A shape keeps its ``WINDOW`` latest samples, and samples older than ``MAX_AGE_STEPS`` observed steps are
forgotten. It is measured once it holds ``MIN_SAMPLES`` of them; its cost is then their low median
(`statistics.median_low`): timing noise only adds time (another process on the cores, a late read), so the lower
middle sample ignores a minority of slow outliers (one sample 10x the others does not move it, nor does the
first run of an executable), while a machine that turns quiet or busy moves it once half the window saw it.

A shape not measured is estimated from the measured ones: a step costs a fixed part per rows column plus a part
per token that every column shares (the weights are read and multiplied per token whatever the rows). The slope
is the least-squares fit over the columns with two or more measured token counts (each column centred on its own
means), never below zero; each column's fixed part comes from its own measured shapes, a column without any takes
the nearest column's (more rows on a tie). Without a slope (no column has two token counts) cost is proportional
to tokens. An estimate never falls below a measured shape of fewer tokens in its column nor above one of more.
"""

from __future__ import annotations

import statistics
from collections import deque

WINDOW = 16  # latest samples per shape
MIN_SAMPLES = 3  # samples before a shape's own cost is used
MAX_AGE_STEPS = 2048  # observed mixed steps after which a sample is forgotten

Shape = tuple[int, int]  # (num_tokens, batch_size) of a mixed bucket


class StepCosts:
    """Seconds per mixed step of each bucket shape: measured medians where steps ran, a fit elsewhere."""

    def __init__(self) -> None:
        self.num_observed = 0  # mixed steps observed so far
        self._samples: dict[Shape, deque[tuple[int, float]]] = {}  # shape -> (observation index, seconds)
        self._costs: dict[Shape, float] = {}  # costs read since the last observation (the budget reads many)
        self._measured: dict[Shape, float] | None = None  # the same for `measured`

    @classmethod
    def from_seconds(cls, seconds: dict[Shape, float]) -> StepCosts:
        """Costs with each shape measured at ``seconds`` (``MIN_SAMPLES`` samples each): for tests and tools."""
        costs = cls()
        for shape, value in seconds.items():
            for _ in range(MIN_SAMPLES):
                costs.observe(*shape, value)
        return costs

    def observe(self, num_tokens: int, batch_size: int, seconds: float) -> None:
        """One mixed step on the ``(num_tokens, batch_size)`` bucket took ``seconds``."""
        window = self._samples.setdefault((num_tokens, batch_size), deque(maxlen=WINDOW))
        window.append((self.num_observed, seconds))
        self.num_observed += 1
        self._costs, self._measured = {}, None

    @property
    def is_ready(self) -> bool:
        """Whether some shape is measured (before that the budget cannot follow a target)."""
        return bool(self.measured())

    def is_measured(self, num_tokens: int, batch_size: int) -> bool:
        return (num_tokens, batch_size) in self.measured()

    def measured(self) -> dict[Shape, float]:
        """The low median of each shape with ``MIN_SAMPLES`` samples younger than ``MAX_AGE_STEPS``."""
        if self._measured is None:
            oldest = self.num_observed - MAX_AGE_STEPS
            fresh = {shape: [s for i, s in window if i >= oldest] for shape, window in self._samples.items()}
            self._measured = {shape: statistics.median_low(s) for shape, s in sorted(fresh.items())
                              if len(s) >= MIN_SAMPLES}
        return self._measured

    def of(self, num_tokens: int, batch_size: int) -> float:
        """Seconds of a step on the shape: measured, else estimated (module docstring). Needs `is_ready`."""
        shape = (num_tokens, batch_size)
        if shape not in self._costs:
            measured = self.measured()
            if not measured:
                raise ValueError("no mixed step shape is measured yet")
            self._costs[shape] = measured[shape] if shape in measured else _estimate(measured, *shape)
        return self._costs[shape]

    def format_table(self, token_counts: list[int], batch_sizes: list[int]) -> str:
        """The shapes' costs in ms, rows by token count; ``~``: estimated from the measured shapes."""
        measured = self.measured()
        lines = ["mixed step cost (ms) | " + " | ".join(f"{b} rows" for b in batch_sizes)]
        for t in token_counts:
            cells = (_cell(measured, t, b) for b in batch_sizes)
            lines.append(f"{t} tokens | " + " | ".join(cells))
        return "\n".join(lines)


def _cell(measured: dict[Shape, float], num_tokens: int, batch_size: int) -> str:
    if (num_tokens, batch_size) in measured:
        return f"{1e3 * measured[(num_tokens, batch_size)]:.1f}"
    return f"~{1e3 * _estimate(measured, num_tokens, batch_size):.1f}" if measured else "-"


def _estimate(measured: dict[Shape, float], num_tokens: int, batch_size: int) -> float:
    """A shape's seconds from the ``measured`` ones: the column's fixed part plus the shared slope, within its
    measured neighbours in the column."""
    columns: dict[int, dict[int, float]] = {}
    for (t, b), seconds in measured.items():
        columns.setdefault(b, {})[t] = seconds
    column = columns.get(batch_size) or columns[_nearest(batch_size, list(columns))]
    slope = _shared_slope(columns)
    if slope is None:  # one token count per column: proportional to tokens through the nearest point
        t0 = min(column, key=lambda t: (abs(t - num_tokens), t))
        estimate = column[t0] * num_tokens / t0
    else:
        intercept = statistics.fmean(column.values()) - slope * statistics.fmean(column)
        estimate = intercept + slope * num_tokens
    below = [column[t] for t in column if t < num_tokens]
    above = [column[t] for t in column if t > num_tokens]
    return min(max(estimate, max(below, default=0.0)), min(above, default=float("inf")))


def _nearest(batch_size: int, batch_sizes: list[int]) -> int:
    return min(batch_sizes, key=lambda b: (abs(b - batch_size), -b))


def _shared_slope(columns: dict[int, dict[int, float]]) -> float | None:
    """Seconds per token over the columns with two or more token counts, each centred on its own means (the
    least-squares slope with a fixed part per column); None when no column has two."""
    sxy = sxx = 0.0
    for column in columns.values():
        if len(column) < 2:
            continue
        mean_t, mean_s = statistics.fmean(column), statistics.fmean(column.values())
        sxy += sum((t - mean_t) * (s - mean_s) for t, s in column.items())
        sxx += sum((t - mean_t) ** 2 for t in column)
    return max(sxy / sxx, 0.0) if sxx else None
