"""What the engine asks of a draft proposer (`LLMEngine._propose_drafts` before scheduling, `_launch` after it).

`propose` gives each decoding sequence its drafts before the scheduler fits them into the step (token budget, KV
blocks). A host proposer (n-gram) knows the tokens then; a model proposer only reserves them (`PENDING_DRAFT`)
and computes the tokens of the rows that kept drafts in `fill_drafts`, once their blocks are allocated.
`release` forgets a sequence that finished, was aborted or was preempted (its blocks are given back).
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens

from jaxserve.core.sequence import Sequence

PENDING_DRAFT = -2  # a draft the scheduler fits now and the proposer fills in before the step's inputs are built


class Proposer:
    """The interface; the defaults are those of a proposer that knows its drafts when it proposes them."""

    def propose(self, token_ids: Tokens[int], max_drafts: int | None = None) -> list[int]:
        raise NotImplementedError

    def fill_drafts(self, rows: list[tuple[Sequence, int, int]]) -> None:
        """Replaces the pending drafts of the step's rows (sequence, first position, tokens) by tokens."""

    def release(self, seq_id: int) -> None:
        """Forgets what the proposer keeps about sequence ``seq_id``."""
