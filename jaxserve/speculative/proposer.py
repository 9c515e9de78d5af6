"""What the engine asks of a draft proposer (`LLMEngine._propose_drafts` before scheduling, `_launch` after it).

`propose` gives each decoding sequence its drafts before the scheduler fits them into the step (token budget, KV
blocks). A host proposer (n-gram) knows the tokens then; a model proposer only reserves them (`PENDING_DRAFT`)
and computes the tokens of the rows that kept drafts in `fill_drafts`, once their blocks are allocated.
A proposer that keeps state per sequence (suffix decoding's tries) is asked through `propose_for`, with the
sequence's id. `release` forgets a sequence that was aborted or preempted (its blocks are given back);
`record_finished` one that finished, whose output a proposer may keep for later requests (suffix decoding).
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens

from jaxserve.core.sequence import Sequence

PENDING_DRAFT = -2  # a draft the scheduler fits now and the proposer fills in before the step's inputs are built


class Proposer:
    """The interface; the defaults are those of a proposer that knows its drafts when it proposes them."""

    def propose(self, token_ids: Tokens[int], max_drafts: int | None = None) -> list[int]:
        raise NotImplementedError

    def propose_for(self, seq_id: int, token_ids: Tokens[int], max_drafts: int | None = None) -> list[int]:
        """`propose` for sequence ``seq_id``, whose tokens only grow between calls."""
        return self.propose(token_ids, max_drafts)

    def fill_drafts(self, rows: list[tuple[Sequence, int, int]]) -> None:
        """Replaces the pending drafts of the step's rows (sequence, first position, tokens) by tokens."""

    def release(self, seq_id: int) -> None:
        """Forgets what the proposer keeps about sequence ``seq_id``."""

    def record_finished(self, seq_id: int, output_token_ids: Tokens[int]) -> None:
        """Sequence ``seq_id`` finished with ``output_token_ids``; by default only forgotten."""
        self.release(seq_id)
