"""How many query tokens a mixed step may hold: a latency target over learned step costs (host side, no JAX).

While sequences decode, every step holds their rows, so a step's duration is their inter-token latency. The
scheduler (`scheduler.py`) asks ``StepBudget.mixed_tokens(num_decode_rows)`` before it adds prefill chunks
to a step with decode rows; with speculative decoding it passes the rows' draft tokens too: a row verifying k
drafts is one row of k + 1 tokens, so the step's cost is read in its rows' column and its drafts take tokens.
With a target (``max_itl_ms``, `jaxserve serve --max-itl-ms`) and the step costs learned from the steps served
so far (`StepCosts`, `cost_model.py`: measured medians, a fit for the shapes not run), the ceiling is the largest
mixed bucket whose step stays within the target, and under it the step follows the queue: the prompts waiting to
be prefilled in one step, or in two where the costs say two smaller steps cost less than one padded one (at
least the untargeted budget either way). So a light queue runs steps sized to it (a lone prompt stalls its
decoders once, or twice where that is cheaper) and a growing queue larger steps, which read the weights once for
more tokens, up to the target. Sarathi-Serve's stall-free batching sets one fixed budget from its latency target;
this one is chosen again every step. Without a target, or before any step shape is measured (the first steps of
a server: nothing is timed at start-up), the budget is the bucket file's ``[mixed] token_budget`` (the best
offline throughput on that platform; else the largest mixed bucket), within ``max_num_batched_tokens``. A step
without decode rows is a prefill step and is not bounded by the target.

A backlog outgrows the target (no starvation): when the prompt tokens waiting to be prefilled exceed what
``DRAIN_STEPS`` steps at the ceiling take beside the decode rows, a queue that arrives faster than capped steps
drain it would wait longer and longer. Then the step grows past the target to the smallest bucket that drains the
backlog in ``DRAIN_STEPS`` steps, at most to the untargeted budget (the throughput-best step: past it a larger
step buys no throughput, only longer stalls) or, while the bucket just above the ceiling is not measured, to that
bucket (so that a cost estimated too high from smaller steps is measured and corrected). Once the backlog is
within ``DRAIN_STEPS`` capped steps the target holds again.
"""

from __future__ import annotations

from jaxserve.core.buckets import BucketGrid
from jaxserve.core.cost_model import StepCosts
from jaxserve.math_utils import cdiv

QUEUE_STEPS = 2  # a step with a latency target splits the waiting prompts in at most this many steps
DRAIN_STEPS = 8  # a backlog that capped steps take more steps than this to drain lets steps grow past the target


class StepBudget:
    def __init__(self, grid: BucketGrid, max_num_batched_tokens: int, max_itl_ms: float | None = None,
                 costs: StepCosts | None = None) -> None:
        if max_itl_ms is not None and not max_itl_ms > 0:
            raise ValueError(f"max_itl_ms must be a positive number of milliseconds, got {max_itl_ms!r}")
        self.grid = grid
        self.max_tokens = min(max_num_batched_tokens, grid.max_mixed_tokens)  # the most a target may allow
        self.untargeted_tokens = min(self.max_tokens, grid.spec.mixed_token_budget or self.max_tokens)
        self.max_itl_ms = max_itl_ms
        self.costs = costs

    @property
    def follows_target(self) -> bool:
        """Whether steps follow the target now: there is one, and some step shape is measured."""
        return self.max_itl_ms is not None and self.costs is not None and self.costs.is_ready

    def mixed_tokens(self, num_decode_rows: int, pending_tokens: int | None = None, num_draft_tokens: int = 0) -> int:
        """Query tokens of a mixed step with ``num_decode_rows`` decode rows verifying ``num_draft_tokens`` drafts
        between them while ``pending_tokens`` prompt tokens wait to be prefilled (None: as many as it takes to fill
        the step). The decode rows and their drafts are among the tokens returned.

        The ceiling is the largest mixed bucket within the target that leaves room for a chunk after the decode
        tokens (the smallest such bucket when none is within it: prefill never stops), its cost read for the
        decode rows and a chunk's row (drafts are tokens of their rows, not rows). Under it the step follows the
        queue: the pending prompts in one step, or in ``QUEUE_STEPS`` where that costs less (`_queue_tokens`), and
        at least the untargeted budget (a short prompt goes through in one step); a backlog grows it past the
        ceiling (`_drain_tokens`). Without a target, or before any step shape is measured: the bucket file's
        ``[mixed] token_budget`` (else ``max_tokens``)."""
        if not self.follows_target:
            return self.untargeted_tokens
        decode_tokens = num_decode_rows + num_draft_tokens
        rows = self._batch_size(num_decode_rows + 1)
        sizes = [t for t in self.grid.spec.mixed_token_counts if decode_tokens < t <= self.max_tokens]
        if rows is None or not sizes:
            return self.max_tokens
        within = [t for t in sizes if self._ms(t, rows) <= self.max_itl_ms]
        ceiling = max(within) if within else min(sizes)
        if pending_tokens is None:
            return ceiling
        if pending_tokens > DRAIN_STEPS * (ceiling - decode_tokens):
            return self._drain_tokens(decode_tokens, pending_tokens, sizes, ceiling, rows)
        return self._queue_tokens(decode_tokens, pending_tokens, within or [ceiling], rows)

    def _drain_tokens(self, decode_tokens: int, pending_tokens: int, sizes: list[int], ceiling: int,
                      rows: int) -> int:
        """A backlog (more pending tokens than ``DRAIN_STEPS`` steps at the ``ceiling`` take): the smallest bucket
        that drains it in ``DRAIN_STEPS`` steps, at most the untargeted budget or, while it is not measured, the
        bucket above the ceiling; never below the ceiling."""
        above = [t for t in sizes if t > ceiling]
        explore = above[0] if above and not self.costs.is_measured(above[0], rows) else ceiling
        cap = max(self.untargeted_tokens, explore)
        drains = min((t for t in sizes if t >= decode_tokens + cdiv(pending_tokens, DRAIN_STEPS)), default=sizes[-1])
        return max(ceiling, min(drains, cap))

    def _queue_tokens(self, decode_tokens: int, pending_tokens: int, sizes: list[int], rows: int) -> int:
        """Under the ceiling (the largest of ``sizes``), after the ``decode_tokens`` of the decode rows: the pending
        prompts in one step when that step costs no more than taking them in ``QUEUE_STEPS`` (its first step, then
        one for the rest), else the first step of that split; never below the untargeted budget. One step is the
        prompt's TTFT and one stall for the decoders, against two: at light load the count of stalls is what sets
        the P99 inter-token latency."""
        ceiling = max(sizes)

        def bucket(num_tokens: int) -> int:
            return min((t for t in sizes if t >= max(num_tokens, self.untargeted_tokens)), default=ceiling)

        split = bucket(decode_tokens + cdiv(pending_tokens, QUEUE_STEPS))
        whole = bucket(decode_tokens + pending_tokens)
        rest = pending_tokens - (split - decode_tokens)
        if whole == split or whole < decode_tokens + pending_tokens or rest <= 0:
            return split
        rest_bucket = min((t for t in sizes if t >= decode_tokens + rest), default=ceiling)
        split_ms = self._ms(split, rows) + self._ms(rest_bucket, rows)
        return whole if self._ms(whole, rows) <= split_ms else split

    def _ms(self, num_tokens: int, batch_size: int) -> float:
        return 1e3 * self.costs.of(num_tokens, batch_size)

    def _batch_size(self, num_rows: int) -> int | None:
        return min((b for b in self.grid.spec.mixed_batch_sizes if b >= num_rows), default=None)

    def describe(self) -> str:
        if not self.follows_target:
            reason = "no --max-itl-ms" if self.max_itl_ms is None else (
                f"until steps are measured, then within {self.max_itl_ms:g} ms: step costs are learned while serving")
            return f"mixed steps up to {self.untargeted_tokens} tokens ({reason})"
        budgets = {d: self.mixed_tokens(d) for d in (0, *self.grid.spec.mixed_batch_sizes[:-1])}
        by_rows = ", ".join(f"{t} tokens from {d} decode rows" for d, t in budgets.items())
        return f"mixed steps within {self.max_itl_ms:g} ms: {by_rows}"
