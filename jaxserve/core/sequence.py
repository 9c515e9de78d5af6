"""Per-request host state.

A ``Sequence`` is created by the engine from a tokenized prompt, queued by the ``Scheduler``, given KV
blocks by the ``BlockManager`` (``block_table``), and advanced by the engine after every model step
(``num_computed_tokens`` and ``append_token``). No JAX here: plain Python lists and ints.

Token accounting (the invariant everything else relies on)::

    all_token_ids = prompt_token_ids + output_token_ids
    [0, num_computed_tokens)            K/V already in the cache
    [num_computed_tokens, num_tokens)   still to be fed to the model (at least 1 while unfinished)

A sequence in decode has exactly one uncomputed token: the last sampled one. Draft tokens of speculative
decoding (``spec_token_ids``) are not part of it: a step feeds them after the last token, and only those it
accepts join ``output_token_ids`` (and their K/V ``num_computed_tokens``). After a recompute
preemption ``num_computed_tokens`` is 0 again and prompt + outputs are re-prefilled.
"""

from __future__ import annotations

import enum
import itertools
import time
from typing import Any

PLACEHOLDER_TOKEN = -1  # a sampled token still on the device (async scheduling), replaced once it is read


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS, stop token or stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens, max_model_len, or too large for the KV pool
    FINISHED_ABORTED = enum.auto()  # aborted by the client

    def is_finished(self) -> bool:
        """``status.is_finished()`` or ``SequenceStatus.is_finished(status)``."""
        return self in _FINISHED


_FINISHED = frozenset(
    {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}
)


class Sequence:
    _ids = itertools.count()

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any = None,
        *,
        seq_id: int | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt must contain at least one token")
        self.seq_id = next(Sequence._ids) if seq_id is None else seq_id
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = 0  # the scheduler's priority policy: lower values are scheduled first
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        # one block table per KV cache group (`config/kv_cache_groups.py`); a sliding group's freed entries: NULL_BLOCK
        self.block_tables: list[list[int]] = [[]]
        self.num_preemptions = 0
        # Sequences still to be forked from this one (n > 1, beam search): the scheduler admits it only
        # when max_num_seqs leaves room for them too.
        self.num_pending_forks = 0
        # Prefix caching: hashes of the full blocks of real tokens so far (prefix_cache.hash_full_blocks),
        # and the prompt tokens served from the cache at the first admission (RequestOutput.num_cached_tokens).
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0  # blocks of block_table already offered to the cache
        self.num_cached_tokens: int | None = None
        self.use_prefix_cache = True  # False: every token is computed (prompt_logprobs need their logits)
        # Speculative decoding: draft tokens for the next step (a proposer's), not yet in the sequence; the step
        # that verifies them feeds them after its last token
        self.spec_token_ids: list[int] = []

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_prompt_tokens}+{self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table})"
        )

    @property
    def block_table(self) -> list[int]:
        """The block table of the first KV cache group (the only one of a model whose layers are alike; a full
        group of a hybrid model): block i holds tokens [i * block_size, (i + 1) * block_size)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables = [table]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def token_ids_with_drafts(self) -> list[int]:
        """The sequence's tokens followed by its draft tokens (what a verifying step feeds)."""
        return self.all_token_ids + self.spec_token_ids if self.spec_token_ids else self.all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than one token still has to go through the model (a prefill chunk)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished()

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(int(token_id))

    def reset_for_recompute(self) -> None:
        """Recompute preemption; the caller has already freed ``block_table``. Outputs are kept."""
        if any(self.block_tables):
            raise RuntimeError(f"seq {self.seq_id}: free its blocks before resetting it for recompute")
        self.num_computed_tokens = 0
        self.spec_token_ids = []
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

    def fork(self, seq_id: int | None = None) -> Sequence:
        """A copy with a new ``seq_id`` and no blocks, for n > 1 / beam search.

        Share the parent's KV with ``BlockManager.fork(parent, child)``.
        """
        child = Sequence(
            self.request_id,
            self.prompt_token_ids,
            self.sampling_params,
            seq_id=seq_id,
            arrival_time=self.arrival_time,
        )
        child.output_token_ids = list(self.output_token_ids)
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child.num_registered_blocks = self.num_registered_blocks
        child.num_cached_tokens = self.num_cached_tokens
        child.use_prefix_cache = self.use_prefix_cache
        child.priority = self.priority
        return child
