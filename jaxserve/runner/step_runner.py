"""The runner's step interface: what the request loop hands the device side each step, and what it gets back.

Place in the data flow, in the shape of vLLM V1's `execute_model` -> sample -> `update_from_output`: the engine
(`engine/llm_engine.py`) takes a `Schedule` from the scheduler and calls `StepRunner.launch` with its bucket, its
rows and each row's request (a `RowRequest`: its sampling values, sampler slot rows and grammar state). The step
runner owns everything between that and the device: the sampler slots of the running sequences (`SlotTable`;
assigned, copied on forks, freed), the copy-on-write copies before the step, the step's padded inputs
(`input_batch.py`) and the sampler's packing, the feeding of the previous step's tokens into rows whose last token is
still on the device (async scheduling), and the `ModelRunner` call. It returns a `LaunchedStep` at once, without
waiting for the device. A constrained row whose grammar waits for the previous step's token is dispatched taking its
argmax; once the host knows its mask, `resample` samples the step's rows again from its logits, on the device.
`collect` waits for a step and gives a `StepResult` on the host: each row's tokens (a verifying step's accepted
drafts, then its token) with their logprobs, and the prompt logprobs of the rows that asked. With a latency target
the engine gives the step runner a `ServedStepTimer` (`step_costs.py`), which `collect` tells each step's duration:
the step costs the scheduler's budget learns from.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

import jax
import numpy as np

from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.model_config import ModelConfig
from jaxserve.core.buckets import BucketGrid
from jaxserve.core.cost_model import StepCosts
from jaxserve.core.sequence import Sequence
from jaxserve.runner.input_batch import Row, StepInputs, initial_token_counts, prepare_step_inputs, step_shape
from jaxserve.runner.model_runner import ModelRunner, StepOutput
from jaxserve.runner.sampler import FLAG_LOGPROBS, FLAG_PROMPT_LOGPROBS, SamplingRow, SamplingTensors
from jaxserve.runner.sampler_state import SlotTable
from jaxserve.runner.spec_verify import VerifyInputs
from jaxserve.runner.step_costs import ServedStepTimer


@dataclasses.dataclass
class SampledToken:
    """One sampled token on the host; the logprob fields are None when no row of its step asked."""

    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top_ids: np.ndarray | None = None  # i32[K]
    top_logprobs: np.ndarray | None = None  # f32[K]


class RowRequest(Protocol):
    """What the step runner asks of a scheduled row's request (the engine's request group)."""

    def sampling_row(self, seq: Sequence, start: int, num_tokens: int) -> SamplingRow:
        """The row's sampling values (without its sampler slot, which the step runner fills in)."""

    def needs_slot(self) -> bool:
        """Whether the request's sequences need a sampler slot (penalties, logit_bias, min_tokens)."""

    def slot_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The request's logit_bias f32[V] and min_tokens mask bool[V], written into a new slot."""

    def mask_waits(self, seq: Sequence) -> bool:
        """Whether ``seq``'s grammar waits for its last token, still on the device."""


@dataclasses.dataclass
class LaunchedStep:
    """A dispatched step, on the device until `StepRunner.collect` reads it."""

    output: StepOutput
    sampling: SamplingTensors  # the rows' sampling inputs as the step would have sampled them (host arrays)
    query_starts: np.ndarray | None  # ragged steps: each row's first token in the step's flat input
    verify: VerifyInputs | None  # a verifying step's sample positions and drafts (host arrays)
    late_mask_rows: frozenset[int]  # rows that took their argmax: their masks waited for the previous step
    bucket: object = None  # the bucket it runs on
    dispatched: float = 0.0  # time.perf_counter() when its dispatch began

    @property
    def flags(self) -> np.ndarray:
        return self.sampling.flags

    @property
    def verifies(self) -> bool:
        """Whether the step verifies drafts (its results hold each row's accepted drafts)."""
        return self.verify is not None

    def wants_prompt_logprobs(self, row: int) -> bool:
        return bool(self.flags[row] & FLAG_PROMPT_LOGPROBS)


@dataclasses.dataclass
class StepResult:
    """A step's results on the host, by row."""

    step: LaunchedStep
    tokens: np.ndarray  # i32[rows]: each row's (last) sampled token
    logprobs: tuple[np.ndarray, ...] | None  # (token logprob, rank, top ids, top logprobs), when a row asked
    prompt_logprobs: tuple[np.ndarray, ...] | None  # the same per prompt position, when a row asked
    num_accepted: np.ndarray | None  # a verifying step: each row's accepted drafts

    @property
    def verifies(self) -> bool:
        return self.num_accepted is not None

    def samples(self, row: int) -> list[SampledToken]:
        """The row's tokens in order: a verifying step's accepted drafts and then its token, else its token."""
        if self.num_accepted is None:
            return [self._sampled(int(self.tokens[row]), row)]
        positions = self.step.verify.row_positions[row, : int(self.num_accepted[row]) + 1]
        kept = [*self.step.verify.draft[positions[:-1]].tolist(), int(self.tokens[row])]
        return [self._sampled(token, position) for token, position in zip(kept, positions, strict=True)]

    def prompt_logprobs_of(self, row: int) -> list[np.ndarray]:
        """The row's prompt logprobs from its first query token on (each of the four arrays)."""
        index, column = (0, int(self.step.query_starts[row])) if self.step.query_starts is not None else (row, 0)
        return [x[index, column:] for x in self.prompt_logprobs]

    def _sampled(self, token: int, i: int) -> SampledToken:
        """``token`` with the logprobs at index ``i`` (a row, or a verifying step's sample position)."""
        if self.logprobs is None:
            return SampledToken(token)
        token_logprob, rank, top_ids, top_logprobs = self.logprobs
        return SampledToken(token, float(token_logprob[i]), int(rank[i]), top_ids[i], top_logprobs[i])


class StepRunner:
    """Owns a step from its `Schedule` to its results: sampler slots, inputs, dispatch, resample, readback."""

    def __init__(self, model: ModelRunner, grid: BucketGrid, vocab_size: int):
        self.model = model  # the device programs (multi-host serving wraps it: `replication/serving_hosts.py`)
        self.block_size = grid.block_size
        self.vocab_size = vocab_size
        self.slots = SlotTable(grid.max_num_seqs)
        self._slot_copies: list[tuple[int, int]] = []  # (parent slot, child slot) of forks not yet copied
        self._fed_tokens: jax.Array | None = None  # the last launched step's tokens, on the device
        self._fed_rows: dict[int, int] = {}  # seq_id -> its row in that step
        self.timer: ServedStepTimer | None = None  # with a latency target: learns the mixed steps' costs

    @classmethod
    def for_engine(cls, model_config: ModelConfig, params: dict, config: EngineConfig, grid: BucketGrid,
                   mesh: jax.sharding.Mesh) -> StepRunner:
        return cls(ModelRunner.for_engine(model_config, params, config, grid, mesh), grid, model_config.vocab_size)

    def learn_step_costs(self, costs: StepCosts, grid: BucketGrid) -> None:
        """From now on every step read back is timed and the mixed ones teach ``costs`` (`step_costs.py`)."""
        self.timer = ServedStepTimer(costs, list(grid.spec.mixed_token_counts), list(grid.spec.mixed_batch_sizes))

    # ----- sequences ----------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` copies ``parent``'s sampler slot (if it has one) before the next step."""
        parent_slot = self.slots.get(parent.seq_id)
        if parent_slot is not None:
            self._slot_copies.append((parent_slot, self.slots.assign(child.seq_id)))

    def release(self, seq: Sequence) -> None:
        """A finished, aborted or preempted sequence gives back its sampler slot (a recompute gets a fresh one)."""
        self.slots.release(seq.seq_id)

    # ----- one step -----------------------------------------------------------------------------
    def launch(self, bucket, rows: list[Row], requests: list[RowRequest],
               block_copies: list[tuple[int, int]]) -> LaunchedStep:
        """Dispatches a `Schedule`'s step, its ``bucket`` and ``rows`` (``requests[i]``: row i's request), after
        the KV blocks' copy-on-write ``block_copies`` (src, dst); returns at once."""
        dispatched = time.perf_counter()
        self._sync_device_state(rows, requests, block_copies)
        inputs = self._inputs(bucket, rows, requests)
        late = frozenset(i for i, ((seq, start, num_tokens), request) in enumerate(zip(rows, requests, strict=True))
                         if start + num_tokens == seq.num_tokens and request.mask_waits(seq))
        sampling = inputs.sampling
        if late:  # sampled in `resample`, once the masks are known
            inputs = dataclasses.replace(inputs, sampling=sampling.argmax_only())
        output = self.model.execute(bucket, inputs, self._fed_tokens)
        self._fed_tokens = output.tokens
        self._fed_rows = {seq.seq_id: row for row, (seq, _, _) in enumerate(rows)}
        return LaunchedStep(output, sampling, inputs.query_starts, inputs.verify, late, bucket, dispatched)

    def resample(self, step: LaunchedStep, masks: dict[int, np.ndarray]) -> None:
        """Samples every row of ``step`` (dispatched taking its argmax) from its logits on the device, each row
        in ``masks`` under its grammar's allowed-token bitmask; the next step reads these tokens."""
        fed = self._fed_tokens is step.output.tokens
        step.output = self.model.resample(step.output, step.sampling.with_grammar_masks(masks))
        if fed:
            self._fed_tokens = step.output.tokens

    def collect(self, step: LaunchedStep) -> StepResult:
        """Waits for ``step`` and reads its results (logprobs only when a row asked)."""
        output = step.output
        tokens = np.asarray(output.tokens)
        logprobs = host_logprobs(output.logprobs) if np.any(step.flags & FLAG_LOGPROBS) else None
        prompt = None
        if output.prompt_logprobs is not None:  # flat over the step's positions: back in its input's shape
            shape = step_shape(step.bucket, self.block_size)
            prompt = tuple(x[: shape.num_tokens].reshape(*shape.input_shape, *x.shape[1:])
                           for x in host_logprobs(output.prompt_logprobs))
        num_accepted = None if output.num_accepted is None else np.asarray(output.num_accepted)
        if self.timer is not None:
            self.timer.ready(step.bucket, step.dispatched)
        return StepResult(step, tokens, logprobs, prompt, num_accepted)

    def _inputs(self, bucket, rows: list[Row], requests: list[RowRequest]) -> StepInputs:
        """The step's padded inputs, each row's sampling values with its sampler slot."""
        sampling_rows = [dataclasses.replace(request.sampling_row(seq, start, num_tokens),
                                             slot=self.slots.get(seq.seq_id))
                         for (seq, start, num_tokens), request in zip(rows, requests, strict=True)]
        return prepare_step_inputs(rows, step_shape(bucket, self.block_size), sampling_rows, self._fed_rows,
                                   self.slots.no_slot, self.vocab_size, self.model.num_kv_groups,
                                   self.model.group_block_offsets)

    def _sync_device_state(self, rows: list[Row], requests: list[RowRequest],
                           block_copies: list[tuple[int, int]]) -> None:
        """Before the step: copy-on-write copies (KV blocks, forked sampler slots), then new slots' reset."""
        writes = []
        for (seq, start, _), request in zip(rows, requests, strict=True):
            if not request.needs_slot() or self.slots.get(seq.seq_id) is not None:
                continue
            # the whole prompt's mask; a slot taken past the prompt (prefix cache hit) the counts up to start
            counts = initial_token_counts(seq, start, self.vocab_size)
            writes.append((self.slots.assign(seq.seq_id), (*request.slot_rows(), *counts)))
        slot_copies, self._slot_copies = self._slot_copies, []
        if block_copies or slot_copies:
            self.model.copy_blocks(block_copies, slot_copies)
        for slot, slot_rows in writes:
            self.model.write_slot(slot, *slot_rows)


def host_logprobs(logprobs) -> tuple[np.ndarray, ...]:
    """(token logprob, rank, top ids, top logprobs) as numpy arrays."""
    return tuple(np.asarray(x) for x in (logprobs.token_logprob, logprobs.token_rank, logprobs.top_ids,
                                         logprobs.top_logprobs))
