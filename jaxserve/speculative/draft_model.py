"""Draft-model proposer: a small model of the target's vocabulary drafts k tokens per decoding row (vLLM's
``{"model": PATH, "num_speculative_tokens": k}``, method ``draft_model``).

Place in the data flow: before scheduling, `propose` reserves k pending drafts for each decoding sequence, so the
scheduler fits them into the step (token budget, KV blocks, copy-on-write); after scheduling, `fill_drafts` runs
the draft model on the rows that kept drafts and writes their tokens in, before the engine builds the verifying
step's inputs (`LLMEngine._launch`).

KV: the draft has its own pool (its layers, heads and head size) with the target's block size and number of
blocks, read through the target's block tables: position p of a sequence lies in the same block id in both
pools. So the prefix cache, forks and copy-on-write need nothing of the draft. The positions a fill writes are
the row's last token and its drafts but the last, in blocks the scheduler made the sequence's own for the
target's step, and earlier positions whose tokens every sequence sharing their block has too.
Which of a sequence's draft K/V is valid (`_DraftKV`): what the draft fed at its last fill, as far as the
sequence still has those tokens (its accepted drafts) and its blocks are the same ids; the rest is fed again at
the next fill (the catch-up): the whole sequence at its first fill, or the rejected draft's position and the
token the target put there. A sequence the engine releases (finished, aborted, preempted) starts over.

One fill: catch-up steps (ragged, on the draft grid's mixed buckets; a long prompt takes several) whose last
position of each row samples its first draft, then one decode step per further draft, each feeding the previous
step's tokens on the device. Drafts are the draft model's argmax: a deterministic proposal, for which the
verifier's rejection sampling against a point mass is exact (`runner/spec_verify.py`).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.model_config import ModelConfig
from jaxserve.core.buckets import BucketGrid
from jaxserve.core.sequence import PLACEHOLDER_TOKEN, Sequence
from jaxserve.runner.input_batch import prepare_step_inputs, step_shape
from jaxserve.runner.model_runner import ModelRunner, StepOutput
from jaxserve.runner.sampler import PAD_FLOATS, SamplingRow
from jaxserve.speculative.proposer import PENDING_DRAFT, Proposer
from jaxserve.weights import LoadedModel, load_model

GREEDY = SamplingRow(PAD_FLOATS)


def draft_bucket_grid(target: BucketGrid, max_rows: int) -> BucketGrid:
    """The draft model's grid: the target's bucket spec (with its verification token counts), block size, pool and
    limits, for at most ``max_rows`` rows (those that get drafts). Only its decode and mixed buckets run."""
    return BucketGrid(
        target.spec, block_size=target.block_size, max_model_len=target.max_model_len,
        max_num_seqs=min(max_rows, target.max_num_seqs), max_num_batched_tokens=target.max_num_batched_tokens,
        num_blocks=target.num_blocks, mixed_token_limit=target.mixed_token_limit,
    )


@dataclasses.dataclass(frozen=True)
class _DraftKV:
    """What a sequence's last fill wrote to the draft pool: its tokens at positions < ``num_real`` and ``drafts`` after
    them, in the blocks ``block_table``."""

    num_real: int
    drafts: tuple[int, ...]
    block_table: tuple[int, ...]


@dataclasses.dataclass
class _RowView:
    """What `prepare_step_inputs` reads of a row's sequence: its tokens with the drafts so far after them."""

    seq_id: int
    token_ids_with_drafts: list[int]
    block_table: list[int]


@dataclasses.dataclass
class _Job:
    """A row that kept drafts: its sequence, its last token's position and its number of drafts."""

    seq: Sequence
    last: int
    num_drafts: int
    view: _RowView
    sampled_at: list[tuple[StepOutput, int]] = dataclasses.field(default_factory=list)  # draft i: (step, row)


class DraftModelProposer(Proposer):
    """Drafts with ``runner`` (the draft model on its pool) over ``grid`` (`draft_bucket_grid`)."""

    def __init__(self, runner: ModelRunner, grid: BucketGrid, num_speculative_tokens: int):
        self.runner = runner
        self.grid = grid
        self.num_speculative_tokens = num_speculative_tokens
        self.num_steps = 0  # draft model steps run
        self.num_fed_tokens = 0  # tokens the catch-up steps fed (the decode steps feed one per draft but the first)
        self.fill_seconds = 0.0  # in fill_drafts, the drafts read back (benchmarks split a step's time with it)
        self._kv: dict[int, _DraftKV] = {}

    @property
    def buckets(self) -> list:
        """The buckets the draft runs (and warm-up compiles)."""
        return draft_buckets(self.grid)

    def propose(self, token_ids, max_drafts: int | None = None) -> list[int]:
        k = self.num_speculative_tokens if max_drafts is None else min(self.num_speculative_tokens, max_drafts)
        return [PENDING_DRAFT] * max(k, 0)

    def release(self, seq_id: int) -> None:
        self._kv.pop(seq_id, None)

    def fill_drafts(self, rows: list[tuple[Sequence, int, int]]) -> None:
        jobs = []
        for seq, start, num_tokens in rows:
            num_drafts = start + num_tokens - seq.num_tokens
            if num_drafts > 0:
                tokens = seq.all_token_ids
                jobs.append(_Job(seq, len(tokens) - 1, num_drafts, _RowView(seq.seq_id, tokens, seq.block_table)))
        if not jobs:
            return
        started = time.perf_counter()
        self._catch_up(jobs)
        self._decode_drafts(jobs)
        host = {id(output): np.asarray(output.tokens) for job in jobs for output, _ in job.sampled_at}
        for job in jobs:
            drafts = [int(host[id(output)][row]) for output, row in job.sampled_at]
            job.seq.spec_token_ids = drafts
            self._kv[job.seq.seq_id] = _DraftKV(job.last + 1, tuple(drafts[:-1]), tuple(job.seq.block_table))
        self.fill_seconds += time.perf_counter() - started

    def _valid_prefix(self, seq: Sequence) -> int:
        """How many of ``seq``'s first positions hold the draft K/V of its tokens (at most all but its last)."""
        kv = self._kv.get(seq.seq_id)
        if kv is None:
            return 0
        outputs = seq.output_token_ids[kv.num_real - seq.num_prompt_tokens :]
        valid = min(kv.num_real + _common_prefix(kv.drafts, outputs), seq.num_tokens - 1)
        same_blocks = _common_prefix(kv.block_table, seq.block_table)  # a copy-on-write changes a block's id
        return min(valid, same_blocks * self.grid.block_size)

    def _catch_up(self, jobs: list[_Job]) -> None:
        """Feeds each job's sequence from its first position without valid draft K/V up to its last token, in as
        many mixed steps as the grid's token and row limits take; a row's step that reaches the last token samples
        its first draft."""
        starts = [self._valid_prefix(job.seq) for job in jobs]
        pending = list(range(len(jobs)))
        while pending:
            rows, members, budget = [], [], self.grid.max_mixed_tokens
            for i in pending:
                if budget == 0 or len(rows) == self.grid.max_mixed_batch_size:
                    break
                num_tokens = min(jobs[i].last + 1 - starts[i], budget)
                rows.append((jobs[i].view, starts[i], num_tokens))
                members.append(i)
                budget -= num_tokens
            bucket = self.grid.select_mixed(len(rows), sum(n for _, _, n in rows), max(s + n for _, s, n in rows))
            output = self._run(bucket, rows)
            self.num_fed_tokens += sum(n for _, _, n in rows)
            for row, (i, (_, _, num_tokens)) in enumerate(zip(members, rows, strict=True)):
                starts[i] += num_tokens
                if starts[i] == jobs[i].last + 1:
                    jobs[i].sampled_at.append((output, row))
                    pending.remove(i)

    def _decode_drafts(self, jobs: list[_Job]) -> None:
        """Drafts 2..n of each job: decode step d feeds each row's draft d-1 from the step that sampled it (on the
        device when that is the step just before; from the host when a long catch-up sampled it earlier)."""
        previous = jobs[0].sampled_at[-1][0] if len({id(job.sampled_at[0][0]) for job in jobs}) == 1 else None
        for d in range(1, max(job.num_drafts for job in jobs)):
            active = [job for job in jobs if job.num_drafts > d]
            previous_rows = {}
            for job in active:
                output, row = job.sampled_at[-1]
                if output is previous:
                    job.view.token_ids_with_drafts.append(PLACEHOLDER_TOKEN)  # fed from the previous step
                    previous_rows[job.seq.seq_id] = row
                else:
                    job.view.token_ids_with_drafts.append(int(np.asarray(output.tokens)[row]))
            rows = [(job.view, job.last + d, 1) for job in active]
            bucket = self.grid.select_decode(len(rows), max(job.last + d + 1 for job in active))
            previous = self._run(bucket, rows, previous, previous_rows)
            for row, job in enumerate(active):
                job.sampled_at.append((previous, row))

    def _run(self, bucket, rows, previous: StepOutput | None = None, previous_rows: dict | None = None) -> StepOutput:
        """Dispatches one greedy step of the draft model on ``rows`` (view, first position, tokens)."""
        shape = step_shape(bucket, self.grid.block_size)
        inputs = prepare_step_inputs(rows, shape, [GREEDY] * len(rows), previous_rows or {},
                                     self.runner.num_sampler_slots, self.runner.config.vocab_size)
        self.num_steps += 1
        return self.runner.execute(bucket, inputs, None if previous is None else previous.tokens)


def _common_prefix(a, b) -> int:
    """The length of the longest common prefix of the sequences ``a`` and ``b``."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def load_draft_model(path: str, target_config: ModelConfig, dtype: str, mesh) -> LoadedModel:
    """The draft model at ``path`` in the engine's dtype; ValueError unless its vocabulary is the target's. Its
    pool follows the target's first block table, so it keeps one KV cache group (`config/kv_cache_groups.py`)."""
    draft = load_model(path, dtype, mesh=mesh)
    check_draft_vocabulary(path, draft.config, target_config)
    return dataclasses.replace(draft, config=dataclasses.replace(draft.config, hybrid_kv_cache=False))


def check_draft_vocabulary(path: str, draft_config: ModelConfig, target_config: ModelConfig) -> None:
    """ValueError unless the draft model at ``path`` has the target's vocabulary (the engine and precompile ask)."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config: the draft model {path} has a vocabulary of {draft_config.vocab_size} "
                         f"tokens, the target's has {target_config.vocab_size}: a draft model must share the target's "
                         "vocabulary")


def build_draft_proposer(draft: LoadedModel, config: EngineConfig, target_grid: BucketGrid, mesh) -> DraftModelProposer:
    """The proposer of an engine with ``config`` on ``target_grid``: the draft on its own runner and grid
    (`draft_runner`)."""
    runner, grid = draft_runner(draft.config, draft.params, config, target_grid, mesh)
    return DraftModelProposer(runner, grid, config.speculative_config.num_speculative_tokens)


def draft_runner(draft_config: ModelConfig, params, config: EngineConfig, target_grid: BucketGrid, mesh, *,
                 abstract: bool = False, platform: str | None = None) -> tuple[ModelRunner, BucketGrid]:
    """The draft model's runner and grid in an engine with ``config`` on ``target_grid``, its pool of the target's
    blocks. Its steps sample greedily for at most disable_by_batch_size rows: one sampler slot (none is used) and one
    top logprob (none is read). The engine and precompile (``abstract``: ``params`` are ``ShapeDtypeStruct``s) both
    build it here, so that they build the same executables (``platform``: a target's, as `ModelRunner.for_engine`)."""
    grid = draft_bucket_grid(target_grid, config.speculative_config.disable_by_batch_size)
    runner = ModelRunner(
        draft_config.for_max_model_len(grid.max_model_len), params, dtype=config.dtype,
        block_size=grid.block_size, num_blocks=grid.num_blocks, max_rows=grid.max_batch_size,
        attention_backend=config.attention_backend, mesh=mesh, num_sampler_slots=1, num_logprobs=1, abstract=abstract,
        platform=platform,
    )
    return runner, grid


def draft_buckets(grid: BucketGrid) -> list:
    """The buckets a draft model on ``grid`` runs (and warm-up and precompile compile): decode and mixed."""
    return [*grid.decode_buckets, *grid.mixed_buckets]
