"""What the scheduler hands on: one step's rows and the bucket they run on (vLLM's `sched/output.py`).

`Scheduler.schedule()` returns a `Schedule`; the engine turns its rows into the step's device inputs
(`runner/input_batch.py`), dispatches the bucket's executable and advances the rows' sequences
(`Schedule.advance`). A plain object: host state only, no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.core.buckets import DecodeBucket, MixedBucket, PrefillBucket
from jaxserve.core.sequence import Sequence


@dataclass
class PrefillChunk:
    """Tokens ``[start, start + num_tokens)`` of ``seq.all_token_ids``; ``start == num_computed_tokens``."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def context_len(self) -> int:
        """Tokens in the cache after this chunk: what its row attends to."""
        return self.end

    @property
    def is_last(self) -> bool:
        """The chunk reaches the end of the sequence: its last logits are sampled."""
        return self.end == self.seq.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.all_token_ids[self.start : self.end]


@dataclass
class Schedule:
    """One model step, decided by ``Scheduler.schedule()``.

    The bucket's rows are ``rows``: the decode sequences (longest first), then the prefill chunks; rows
    past them are padding. The blocks for every row's new tokens are already allocated.

    The scheduler does not advance sequences: once the step is dispatched the engine calls ``advance``,
    which counts every row's tokens as computed and names the rows that sample (decode rows and chunks
    that end their sequence); the engine appends each one's token (a placeholder until it is read).

    ``preempted``: sequences moved back to the waiting queue during this call (recompute).
    ``ignored``: sequences finished here (``FINISHED_LENGTH``) because they can never run; the engine
    must emit their final output.
    """

    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    decode_seqs: list[Sequence] = field(default_factory=list)
    bucket: PrefillBucket | DecodeBucket | MixedBucket | None = None
    preempted: list[Sequence] = field(default_factory=list)
    ignored: list[Sequence] = field(default_factory=list)

    @property
    def is_prefill(self) -> bool:
        return bool(self.prefill_chunks)

    @property
    def is_decode(self) -> bool:
        return bool(self.decode_seqs)

    @property
    def num_rows(self) -> int:
        return len(self.decode_seqs) + len(self.prefill_chunks)

    @property
    def is_mixed(self) -> bool:
        """Decode rows and prefill chunks in one step."""
        return bool(self.decode_seqs) and bool(self.prefill_chunks)

    @property
    def is_idle(self) -> bool:
        return not self.prefill_chunks and not self.decode_seqs

    @property
    def kind(self) -> str:
        """"mixed", "prefill" (chunks only) or "decode" (decode rows only)."""
        if self.is_mixed:
            return "mixed"
        return "prefill" if self.is_prefill else "decode"

    @property
    def rows(self) -> list[tuple[Sequence, int, int]]:
        """(sequence, first position, number of tokens) of every row, in row order: decode rows longest first
        (rows of similar length share the attention's row groups, see attention/backends.py), then the chunks.
        A decode row's tokens are its last token and its drafts (speculative decoding)."""
        decode = sorted(self.decode_seqs, key=lambda seq: -seq.num_computed_tokens)
        chunks = [(c.seq, c.start, c.num_tokens) for c in self.prefill_chunks]
        return [(seq, seq.num_computed_tokens, 1 + len(seq.spec_token_ids)) for seq in decode] + chunks

    @property
    def seqs(self) -> list[Sequence]:
        """The sequences of the rows, in row order."""
        return [seq for seq, _, _ in self.rows]

    @property
    def context_lens(self) -> list[int]:
        """Per row: tokens in the cache after the step."""
        return [start + num_tokens for _, start, num_tokens in self.rows]

    @property
    def num_prefill_tokens(self) -> int:
        """Query tokens of the step's prefill chunks."""
        return sum(c.num_tokens for c in self.prefill_chunks)

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens the step's decode rows verify."""
        return sum(len(seq.spec_token_ids) for seq in self.decode_seqs)

    @property
    def num_batched_tokens(self) -> int:
        """Real query tokens of the step."""
        return self.num_prefill_tokens + len(self.decode_seqs) + self.num_draft_tokens

    @property
    def num_padded_tokens(self) -> int:
        """Bucket query tokens minus real ones."""
        return self.bucket.num_tokens - self.num_batched_tokens if self.bucket is not None else 0

    def advance(self) -> list[int]:
        """Counts the step's tokens as computed (``num_computed_tokens``) and returns, in row order, the rows
        whose sequence reached its last token: the rows whose sampled token it appends. A row's drafts are not
        counted: the engine counts those accepted once it has read the step."""
        sampling = []
        for row, (seq, start, num_tokens) in enumerate(self.rows):
            seq.num_computed_tokens += min(num_tokens, seq.num_tokens - start)
            if seq.num_computed_tokens == seq.num_tokens:  # a decode row, or a chunk that ends the sequence
                sampling.append(row)
        return sampling
