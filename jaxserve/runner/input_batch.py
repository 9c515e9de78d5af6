"""A step's inputs: the static shape of each bucket's executable and the padded host arrays of one step.

Place in the data flow: the step runner (`step_runner.py`) takes a `Schedule`'s rows (sequence, first position, number
of tokens) and each row's `SamplingRow` and calls `prepare_step_inputs`, which lays the rows' tokens out as the
bucket's executable takes them (rows of equal length, or for a mixed step back to back: `StepShape.ragged`), with
their block tables, positions and the sampling arrays, padded to the bucket's shape. The `ModelRunner` dispatches the
executable of `step_shape(bucket)` on them. A row whose last token is still on the device (async scheduling: a
placeholder) is fed from the previous step's output, at `feed_rows`/`feed_cols`."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.core.buckets import MixedBucket
from jaxserve.core.sequence import PLACEHOLDER_TOKEN, Sequence
from jaxserve.math_utils import cdiv
from jaxserve.runner.sampler import SamplingRow, SamplingTensors
from jaxserve.runner.spec_verify import VerifyInputs


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The static shape of one executable: S sequences, P pages of block table, and either Q query tokens per
    sequence (padded: input `[S, Q]`) or Q query tokens in all, rows back to back (ragged: input `[1, Q]`)."""

    batch_size: int
    num_query_tokens: int
    pages_per_seq: int
    ragged: bool = False
    num_sample_positions: int = 0  # a speculative engine's mixed step: P sampled positions (0: one per row)
    num_speculative_tokens: int = 0  # K, the most drafts of a row (`spec_verify.VerifyInputs`)

    @property
    def input_shape(self) -> tuple[int, int]:
        return (1, self.num_query_tokens) if self.ragged else (self.batch_size, self.num_query_tokens)

    @property
    def num_tokens(self) -> int:
        """Query tokens of the step, padding included (its input's size)."""
        return self.batch_size * self.num_query_tokens if not self.ragged else self.num_query_tokens

    @property
    def sample_shape(self) -> SampleShape:
        return SampleShape(self.batch_size, self.num_sample_positions, self.num_speculative_tokens)

    @property
    def kind(self) -> str:
        """The step kind of its bucket: "mixed" (ragged), "decode" (one query token per row) or "prefill"."""
        return "mixed" if self.ragged else "decode" if self.num_query_tokens == 1 else "prefill"


@dataclasses.dataclass(frozen=True)
class SampleShape:
    """The static shape of a sampler executable, which samples the logits of every step of this shape whatever
    its tokens and context: S rows, and in a speculative engine's mixed step P sample positions of rows with at
    most K drafts (`spec_verify.VerifyInputs`)."""

    batch_size: int
    num_sample_positions: int = 0
    num_speculative_tokens: int = 0


def step_shape(bucket, block_size: int) -> StepShape:
    """Prefill buckets have `chunk_len` query tokens per sequence, decode buckets one; a mixed bucket has
    `num_tokens` in all, laid out ragged (and in a speculative engine its sample positions)."""
    pages = cdiv(bucket.context_len, block_size)
    if isinstance(bucket, MixedBucket):
        return StepShape(bucket.batch_size, bucket.num_tokens, pages, ragged=True,
                         num_sample_positions=bucket.num_sample_positions,
                         num_speculative_tokens=bucket.num_speculative_tokens)
    return StepShape(bucket.batch_size, getattr(bucket, "chunk_len", 1), pages)


@dataclasses.dataclass
class StepInputs:
    """Host-side, already padded to the bucket's shape. Columns count from a row's first query token."""

    input_ids: np.ndarray  # i32[S, Q] (ragged: i32[1, T])
    block_tables: np.ndarray  # i32[S, P], or i32[G, S, P] with G KV cache groups
    q_start: np.ndarray  # i32[S]
    lengths: np.ndarray  # i32[S]
    sample_index: np.ndarray  # i32[S], the column of the query token whose logits are sampled
    sampling: SamplingTensors
    feed_rows: np.ndarray | None = None  # i32[S], row of the previous step's tokens to feed in
    feed_cols: np.ndarray | None = None  # i32[S], column of the row that token replaces; -1: none
    query_starts: np.ndarray | None = None  # i32[S], ragged steps: each row's first token in input_ids[0]
    verify: VerifyInputs | None = None  # a speculative engine's mixed step: its sample positions and drafts


Row = tuple[Sequence, int, int]  # (sequence, first position, number of tokens): a Schedule's row


def prepare_step_inputs(rows: list[Row], shape: StepShape, sampling_rows: list[SamplingRow],
                        previous_rows: dict[int, int], no_slot: int, vocab_size: int,
                        num_kv_groups: int = 1, group_block_offsets: tuple[int, ...] | None = None) -> StepInputs:
    """The padded inputs of a step of ``rows`` on an executable of ``shape``; ``sampling_rows`` are the rows'
    sampling values. A row whose last token is a placeholder takes it from the previous step's output, at that
    sequence's row there (``previous_rows``: seq_id -> row). With several KV cache groups the block tables are
    ``[num_kv_groups, S, P]``; ``group_block_offsets``: per group, the first block id of its kind of page (a pool
    of pages of several shapes, `config/kv_cache_groups.py`), which its table is read less."""
    s, p = shape.batch_size, shape.pages_per_seq
    input_ids = np.zeros(shape.input_shape, np.int32)
    block_tables = np.zeros((num_kv_groups, s, p), np.int32)
    q_start, lengths, sample_index, feed_rows = (np.zeros(s, np.int32) for _ in range(4))
    feed_cols = np.full(s, -1, np.int32)
    # ragged: row i's tokens start where row i-1's end; padding rows start past the last token
    query_starts = np.full(s, shape.num_query_tokens, np.int32) if shape.ragged else None
    flat = input_ids.reshape(-1)
    offset = 0
    for i, (seq, start, num_tokens) in enumerate(rows):
        if query_starts is not None:
            query_starts[i] = offset
        else:
            offset = i * shape.num_query_tokens
        flat[offset : offset + num_tokens] = seq.token_ids_with_drafts[start : start + num_tokens]
        if flat[offset + num_tokens - 1] == PLACEHOLDER_TOKEN:  # only ever a sequence's last token
            feed_rows[i], feed_cols[i] = previous_rows[seq.seq_id], num_tokens - 1
        offset += num_tokens
        tables = seq.block_tables if num_kv_groups > 1 else [seq.block_table]
        for group, table in enumerate(tables):
            table = table[:p]  # blocks past this step's context (reserved ahead) are not read
            block_tables[group, i, : len(table)] = table
        q_start[i], lengths[i], sample_index[i] = start, start + num_tokens, num_tokens - 1
    sampling = SamplingTensors.from_rows(sampling_rows, s, no_slot, vocab_size)
    verify = None
    if shape.num_sample_positions:
        drafts = [row_drafts(seq, start, num_tokens) for seq, start, num_tokens in rows]
        verify = VerifyInputs.from_rows(list(query_starts[: len(rows)]), [n for _, _, n in rows], drafts,
                                        shape.num_sample_positions, s, shape.num_speculative_tokens)
    first_ids = np.zeros(num_kv_groups, np.int32) if group_block_offsets is None else np.asarray(group_block_offsets)
    # a sliding group's NULL_BLOCK: read as block 0, masked out
    block_tables = np.where(block_tables >= 0, block_tables - first_ids[:, None, None].astype(np.int32), 0)
    if num_kv_groups == 1:
        block_tables = block_tables[0]
    return StepInputs(input_ids, block_tables, q_start, lengths, sample_index, sampling, feed_rows, feed_cols,
                      query_starts, verify)


def tables_of_every_group(tables: np.ndarray, num_kv_groups: int) -> np.ndarray:
    """Block tables ``[S, P]`` as a step of a model with ``num_kv_groups`` KV cache groups takes them, every group
    on the same blocks (cost probes and benchmarks, whose values do not matter)."""
    return tables if num_kv_groups == 1 else np.broadcast_to(tables, (num_kv_groups, *tables.shape)).copy()


def row_drafts(seq: Sequence, start: int, num_tokens: int) -> list[int]:
    """The draft tokens a row ends with: its sequence's, when the row reaches past the sequence's tokens."""
    num_drafts = start + num_tokens - seq.num_tokens
    return seq.spec_token_ids[:num_drafts] if num_drafts > 0 else []


def initial_token_counts(seq: Sequence, start: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(output counts i32[V], prompt mask bool[V]) that ``seq``'s sampler slot starts with when its first step
    starts at position ``start``: the counts of the generated tokens before ``start`` (what the steps would
    have counted had they fed them, `update_token_counts`) and the mask of its whole prompt."""
    prompt_mask = np.zeros(vocab_size, bool)
    prompt_mask[np.asarray(seq.prompt_token_ids, np.int64)] = True
    generated = np.asarray(seq.all_token_ids[seq.num_prompt_tokens : max(start, seq.num_prompt_tokens)], np.int64)
    output_counts = np.bincount(generated, minlength=vocab_size).astype(np.int32)
    return output_counts, prompt_mask
