"""Continuous batching policy (host side, no JAX).

``LLMEngine.step()`` calls ``Scheduler.schedule()``, which only changes host state (queues, block
tables) and returns a plain ``Schedule`` (``schedule.py``): the rows of one step and the bucket it runs
on. The engine builds the step's inputs from the rows (``runner/input_batch.py``), dispatches the bucket's
executable and advances the rows' sequences (``Schedule.advance``); it checks stop conditions and calls
``finish`` on finished ones.

A step is a prefill step (chunks of prompts, on a ``PrefillBucket``), a decode step (one token per
running sequence, on a ``DecodeBucket``) or, when the grid has mixed buckets, a mixed step (decode rows
and prefill chunks together, on a ``MixedBucket``): different executables.

Policy
  * Queues: ``waiting`` and ``running``. The policy (vLLM's ``--scheduling-policy``) orders them: ``fcfs``, by
    arrival (preempted sequences go back to the front of ``waiting``); ``priority``, by the requests'
    ``priority`` (lower first), then arrival (a preempted sequence goes back to its place in that order).
  * Mixed steps (vLLM V1's policy; grids with ``[mixed]`` buckets): whenever a sequence decodes, every
    decoding sequence gets its row (oldest first), then the remaining token budget (``StepBudget``,
    `step_budget.py`: the largest mixed bucket within the latency target ``max_itl_ms`` by the step costs
    learned while serving, past it for a backlog, else the untargeted budget, within ``max_num_batched_tokens``;
    minus the decode rows) and rows go to prefill chunks: mid-prefill sequences oldest first, then admissions
    from the waiting queue as below. So no decoding sequence ever waits behind a prefill; a prefill waits only
    when decode rows fill the step. A chunk that does not end its prompt is cut so the step's tokens fill a
    mixed bucket exactly. A step without decode rows is a prefill step as below; one without chunks a decode step.
  * Speculative decoding (a grid with ``speculative``): a decoding sequence's draft tokens
    (``Sequence.spec_token_ids``, set by the engine's proposer) join its row, so the step is a mixed step even
    without chunks. Drafts are cut to the step's token budget and to the KV blocks free now (a draft never
    preempts), and dropped for every row when more sequences decode than the grid makes room for
    (``disable_by_batch_size``). The prefill chunks get the budget the rows and their drafts leave; the step
    budget counts a row and its drafts as one row of their tokens (its cost column is the rows').
  * Prefill or decode (grids without mixed buckets): a prefill step runs when some running sequence is
    mid-prefill (it keeps priority until its prompt is in the cache), or when waiting sequences may be
    admitted: no sequence is decoding, or ``num_waiting >= waiting_served_ratio * num_decoding`` (TGI),
    or the decoders already ran ``max_waiting_steps`` decode steps while requests waited (TGI's
    ``max_waiting_tokens``). Otherwise, or when nothing could be prefilled, all decoders decode.
  * Prefill batch: mid-prefill sequences first (oldest first), then admissions from the head of the
    waiting queue, while ``max_num_seqs`` (counting the sequences a request will fork: n > 1, beam
    search, ``Sequence.num_pending_forks``), the token budget ``max_num_batched_tokens`` and free blocks
    allow. A chunk is at most the largest chunk bucket; a sequence joins a non-empty batch only if
    the padded bucket stays within ``max_num_batched_tokens``. Admission takes the blocks of the
    sequence's whole prefill (not just its first chunk), leaves free the blocks the decoders need for
    their next token, and never skips the queue head (no starvation of long prompts).
  * Prefix caching (a block manager with ``enable_prefix_caching``): an admitted sequence starts on the
    longest cached prefix of its full blocks (never its last token) and its first chunk starts after it.
  * Preemption by recompute: when a running sequence needs a block and none is free, the NEWEST
    running sequence (by arrival; under ``priority``, the newest of the largest priority value, as vLLM's) is
    preempted: its blocks are freed (with prefix caching its computed
    full blocks stay cached until evicted), ``num_computed_tokens`` reset and it is pushed to the front
    of the waiting queue (its outputs are kept and re-prefilled, after its cached prefix). This
    repeats until the older sequence fits, or the sequence itself is the newest.
  * A sequence that can never run (more tokens than ``max_model_len``; the grid guarantees the KV
    pool holds one sequence of ``max_model_len``, so this covers "larger than the pool") is finished
    with ``FINISHED_LENGTH`` and reported in ``Schedule.ignored``, so no loop waits on it forever.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from jaxserve.config.engine_config import SCHEDULING_POLICIES
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.buckets import BucketGrid, DecodeBucket, MixedBucket
from jaxserve.core.schedule import PrefillChunk, Schedule
from jaxserve.core.sequence import Sequence, SequenceStatus
from jaxserve.core.step_budget import DRAIN_STEPS, StepBudget

# Prefill-vs-decode knob (TGI's waiting_served_ratio; TGI ships 1.2 with max_waiting_tokens=20).
# Default 0.0 = admit whenever a request waits and fits (vLLM's prefill-first). In a step-cost
# simulation of this scheduler (GPU-like costs, Poisson arrivals, gpu.toml buckets) 0.0 gave the best
# throughput and TTFT at every load (at 15 req/s: 3180 vs 2850 tok/s, TTFT 37 ms vs 3.1 s for 1.2)
# for ~20% higher mean inter-token latency (p99 about equal). It is a model, not a measurement:
# measure with a serving benchmark sweeping ratio in {0, 0.3, 0.6, 1.2, 2.4} at several request
# rates, and compare throughput, TTFT and ITL (mean, p99).
DEFAULT_WAITING_SERVED_RATIO = 0.0
DEFAULT_MAX_WAITING_STEPS = 20


def _num_requests(seqs: Iterable[Sequence]) -> int:
    """list() copies atomically under the GIL, so a metrics scrape never iterates a queue the step thread is
    changing."""
    return len({seq.request_id for seq in list(seqs)})


def _age(seq: Sequence) -> tuple[float, int]:
    return seq.arrival_time, seq.seq_id


def _priority_then_age(seq: Sequence) -> tuple[int, float, int]:
    return seq.priority, seq.arrival_time, seq.seq_id


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        bucket_grid: BucketGrid,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        waiting_served_ratio: float = DEFAULT_WAITING_SERVED_RATIO,
        max_waiting_steps: int = DEFAULT_MAX_WAITING_STEPS,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
    ) -> None:
        grid = bucket_grid
        if (block_manager.num_blocks, block_manager.block_size) != (grid.num_blocks, grid.block_size):
            raise ValueError(
                f"the bucket grid was pruned for {grid.num_blocks} blocks of {grid.block_size}, but the "
                f"block manager has {block_manager.num_blocks} blocks of {block_manager.block_size}"
            )
        if not 1 <= max_num_seqs <= grid.max_num_seqs:
            raise ValueError(
                f"max_num_seqs must be in [1, {grid.max_num_seqs}] (the grid's), got {max_num_seqs}"
            )
        if not 1 <= max_num_batched_tokens <= grid.max_num_batched_tokens:
            raise ValueError(
                f"max_num_batched_tokens must be in [1, {grid.max_num_batched_tokens}] (the grid's), "
                f"got {max_num_batched_tokens}"
            )
        if waiting_served_ratio < 0:
            raise ValueError(f"waiting_served_ratio must be >= 0, got {waiting_served_ratio}")
        if max_waiting_steps < 0:
            raise ValueError(f"max_waiting_steps must be >= 0, got {max_waiting_steps}")
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
        self.block_manager = block_manager
        self.bucket_grid = grid
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = grid.max_model_len
        self.max_chunk_len = min(grid.max_chunk_len, max_num_batched_tokens)
        self.waiting_served_ratio = waiting_served_ratio
        self.max_waiting_steps = max_waiting_steps
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self._order = _age if policy == "fcfs" else _priority_then_age  # first scheduled first, preempted last
        self.step_budget = StepBudget(grid, max_num_batched_tokens)  # the engine sets one with a target and costs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_decode_steps_waited = 0  # decode steps since the last admission while requests waited

    # -- queues -------------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_running_requests(self) -> int:
        """Requests, not sequences (n > 1 and beams run several)."""
        return _num_requests(self.running)

    @property
    def num_waiting_requests(self) -> int:
        return _num_requests(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise ValueError(f"seq {seq.seq_id}: only new WAITING sequences without blocks can be added")
        if seq.num_tokens > self.max_model_len:
            raise ValueError(
                f"seq {seq.seq_id}: {seq.num_tokens} tokens exceed max_model_len={self.max_model_len}"
            )
        if self.policy == "fcfs":
            self.waiting.append(seq)
        else:
            self._insert_waiting(seq)

    def _insert_waiting(self, seq: Sequence) -> None:
        """Priority policy: ``seq`` joins ``waiting`` after every sequence that comes before it in the order."""
        key = self._order(seq)
        index = next((i for i, other in enumerate(self.waiting) if self._order(other) > key), len(self.waiting))
        self.waiting.insert(index, seq)

    def add_forked(self, seq: Sequence) -> None:
        """A sequence forked from a running one (n > 1, beam search) joins ``running`` directly.

        It already shares its parent's blocks (``BlockManager.fork``); its admission was accounted
        for by the parent's ``num_pending_forks``."""
        if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens < 1:
            raise ValueError(f"seq {seq.seq_id}: a forked sequence must be RUNNING with a token to compute")
        self.running.append(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Abort every sequence of ``request_id``, waiting or running; returns them."""
        aborted = [s for s in self.waiting if s.request_id == request_id]
        for seq in aborted:
            self.waiting.remove(seq)
        running = [s for s in self.running if s.request_id == request_id]
        for seq in running:
            self.running.remove(seq)
        aborted += running
        for seq in aborted:
            self.block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED_ABORTED
        return aborted

    def finish(self, seq: Sequence, status: SequenceStatus | None = None) -> None:
        """Called by the engine for a finished sequence: frees its blocks, removes it from the queues."""
        if status is not None:
            if not status.is_finished():
                raise ValueError(f"finish needs a FINISHED_* status, got {status.name}")
            seq.status = status
        elif not seq.is_finished:
            seq.status = SequenceStatus.FINISHED_STOPPED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    # -- scheduling ---------------------------------------------------------------------------------

    def schedule(self) -> Schedule:
        sched = Schedule()
        if self.block_manager.has_sliding_groups:  # what the sliding windows passed since the last step goes back
            for seq in self.running:
                self.block_manager.release_out_of_window(seq)
        partial, decoding = self._classify_running(sched)
        if self.bucket_grid.has_mixed and decoding:
            self._schedule_decode(sched, decoding)
            if sched.decode_seqs:
                self._schedule_mixed_prefill(sched, partial)
                sched.bucket = self._select_mixed_or_decode(sched)
                return sched
            # every decoder was preempted (they are waiting now): this step prefills as below
        if partial or self._admission_open(len(decoding)):
            self._schedule_prefill(sched, partial, decoding)
            if sched.prefill_chunks:
                chunks = sched.prefill_chunks
                sched.bucket = self.bucket_grid.select_prefill(
                    len(chunks), max(c.num_tokens for c in chunks), max(c.context_len for c in chunks)
                )
                return sched
        self._schedule_decode(sched, decoding)
        if sched.decode_seqs:
            sched.bucket = self.bucket_grid.select_decode(len(sched.decode_seqs), max(sched.context_lens))
        return sched

    def _schedule_mixed_prefill(self, sched: Schedule, partial: list[Sequence]) -> None:
        """Prefill chunks after this step's decode rows, within the mixed step's token budget and rows."""
        pending = self._pending_prefill_tokens(partial) if self.step_budget.follows_target else None
        # drafts are tokens of their decode rows, not rows: the step budget reads the rows' cost column
        budget = self.step_budget.mixed_tokens(len(sched.decode_seqs), pending, sched.num_draft_tokens)
        budget -= sched.num_batched_tokens  # the decode rows and their drafts
        for seq in partial:
            if budget < 1 or not self._mixed_row_free(sched):
                return
            if seq.status is not SequenceStatus.RUNNING:  # preempted for an older decoder
                continue
            n = self._mixed_chunk_len(seq, budget, sched)
            # blocks for the whole prefill were taken at admission; never preempt the step's decode rows
            if n == 0 or not self.block_manager.can_allocate(seq, n):
                return
            self.block_manager.allocate(seq, n)
            sched.prefill_chunks.append(PrefillChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        if self._admission_open(len(sched.decode_seqs)):
            self._admit(sched, budget, sched.decode_seqs, mixed=True)

    def _pending_prefill_tokens(self, partial: list[Sequence]) -> int:
        """Prompt tokens waiting to be prefilled: the rest of the mid-prefill sequences' and the waiting ones' (whole,
        before any cached prefix), counted only as far as ``DRAIN_STEPS`` of the largest steps could take."""
        pending = sum(seq.num_uncomputed_tokens for seq in partial)
        for seq in self.waiting:
            if pending > self.step_budget.max_tokens * DRAIN_STEPS:
                break
            pending += seq.num_tokens
        return pending

    def _mixed_row_free(self, sched: Schedule) -> bool:
        return sched.num_rows < self.bucket_grid.max_mixed_batch_size

    def _mixed_chunk_len(self, seq: Sequence, budget: int, sched: Schedule, start: int | None = None) -> int:
        """Tokens of ``seq`` to prefill in a mixed step from ``start`` (default: its computed tokens); 0 when it
        cannot join. A chunk that does not end the prompt is cut so that the step's tokens fill the largest
        mixed bucket they can (no padding)."""
        remaining = seq.num_tokens - (seq.num_computed_tokens if start is None else start)
        n = min(remaining, budget)
        if n < 1:
            return 0
        if n == remaining:
            return n
        if not (self.enable_chunked_prefill or remaining > self.max_chunk_len):
            return 0  # not splittable: it waits for a step with room for all of it
        used = sched.num_batched_tokens
        fills = [t for t in self.bucket_grid.spec.mixed_token_counts if used < t <= used + n]
        return fills[-1] - used if fills else n

    def _select_mixed_or_decode(self, sched: Schedule) -> MixedBucket | DecodeBucket:
        max_context = max(sched.context_lens)
        if sched.prefill_chunks or sched.num_draft_tokens:
            return self.bucket_grid.select_mixed(sched.num_rows, sched.num_batched_tokens, max_context)
        return self.bucket_grid.select_decode(len(sched.decode_seqs), max_context)

    def _admission_open(self, num_decoding: int) -> bool:
        if not self.waiting:
            return False
        return (
            num_decoding == 0
            or len(self.waiting) >= self.waiting_served_ratio * num_decoding
            or self.num_decode_steps_waited >= self.max_waiting_steps
        )

    def _classify_running(self, sched: Schedule) -> tuple[list[Sequence], list[Sequence]]:
        """Mid-prefill and decoding sequences, first in the policy's order first (oldest first under fcfs); finishes
        those beyond max_model_len."""
        partial, decoding = [], []
        for seq in sorted(self.running, key=self._order):
            num_tokens = seq.num_tokens
            uncomputed = num_tokens - seq.num_computed_tokens
            if uncomputed < 1:
                raise RuntimeError(
                    f"seq {seq.seq_id} has no token to compute: the engine must append the sampled token "
                    "after a step (Schedule.advance)"
                )
            if num_tokens > self.max_model_len:
                self._ignore(seq, sched)
            else:
                (partial if uncomputed > 1 else decoding).append(seq)
        return partial, decoding

    def _ignore(self, seq: Sequence, sched: Schedule) -> None:
        self.finish(seq, SequenceStatus.FINISHED_LENGTH)
        sched.ignored.append(seq)

    def _schedule_prefill(self, sched: Schedule, partial: list[Sequence], decoding: list[Sequence]) -> None:
        budget = self.max_num_batched_tokens
        for seq in partial:
            if seq.status is not SequenceStatus.RUNNING:  # preempted for an older sequence
                continue
            n = self._chunk_len(seq, budget, sched.prefill_chunks)
            if n == 0:
                break
            # Blocks for the whole prefill were taken at admission, so this only preempts if a
            # sequence lost them some other way.
            if not self._reserve(seq, n, sched):
                break  # seq itself was the newest: every newer sequence is gone too
            sched.prefill_chunks.append(PrefillChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        decoding = [s for s in decoding if s.status is SequenceStatus.RUNNING]  # some may be preempted
        if self._admission_open(len(decoding)):
            self._admit(sched, budget, decoding)

    def _admit(self, sched: Schedule, budget: int, decoding: list[Sequence], *, mixed: bool = False) -> None:
        # keep free the blocks the decoders need for their next token (in a mixed step, this step's are taken)
        reserve = [sum(need) for need in zip(*(self.block_manager.new_blocks_by_kind(s, 2 if mixed else 1)
                                               for s in decoding), strict=True)] or 0  # per kind of page
        admitted = False
        num_seqs = len(self.running) + sum(s.num_pending_forks for s in self.running)
        while self.waiting and num_seqs + 1 + self.waiting[0].num_pending_forks <= self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_tokens > self.max_model_len:
                self.waiting.popleft()
                self._ignore(seq, sched)
                continue
            if mixed and not self._mixed_row_free(sched):
                break
            prefix = self.block_manager.cached_prefix(seq)  # prefix caching: its longest cached full blocks
            start = len(prefix[0]) * self.block_manager.block_size
            if mixed:
                n = self._mixed_chunk_len(seq, budget, sched, start)
            else:
                n = self._chunk_len(seq, budget, sched.prefill_chunks, start)
            # Take the blocks of the whole prefill now: a sequence admitted with its first chunk's
            # blocks only could stall mid-prefill, preempt itself and be re-admitted, forever.
            # (a sliding-window group only the blocks of its first chunk: it gives blocks back as the prompt goes on)
            if n == 0 or not self.block_manager.can_allocate_with_prefix(
                    seq, prefix, reserve=reserve, max_chunk_tokens=self.max_num_batched_tokens):
                break
            self.waiting.popleft()
            self.block_manager.allocate_prefix(seq, prefix)
            self.block_manager.allocate(seq, seq.num_uncomputed_tokens, num_sliding_tokens=n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            sched.prefill_chunks.append(PrefillChunk(seq, start, n))
            budget -= n
            num_seqs += 1 + seq.num_pending_forks
            admitted = True
        if admitted or not self.waiting:
            self.num_decode_steps_waited = 0

    def _chunk_len(self, seq: Sequence, budget: int, chunks: list[PrefillChunk], start: int | None = None) -> int:
        """Tokens of ``seq`` to prefill in this step from ``start`` (default: its computed tokens); 0 when it
        cannot join the batch."""
        start = seq.num_computed_tokens if start is None else start
        remaining = seq.num_tokens - start
        n = min(remaining, self.max_chunk_len, budget)
        if n < 1:
            return 0
        # Without chunked prefill a sequence is split only when no single step could hold it.
        splittable = self.enable_chunked_prefill or remaining > self.max_chunk_len
        if n < remaining and not splittable:
            return 0
        if not chunks:
            return self._least_padded_chunk(n) if splittable else n
        # Joining: the padded bucket must stay within the token budget; try shorter chunks too.
        candidates = [n]
        if splittable:
            candidates += [length for length in reversed(self.bucket_grid.spec.prefill_lengths) if length < n]
        for length in candidates:
            bucket = self.bucket_grid.find_prefill(
                len(chunks) + 1,
                max(length, *(c.num_tokens for c in chunks)),
                max(start + length, *(c.context_len for c in chunks)),
            )
            if bucket is not None and bucket.num_tokens <= self.max_num_batched_tokens:
                return length
        return 0

    def _least_padded_chunk(self, n: int) -> int:
        """Splits off the largest chunk bucket below ``n`` when that saves padded tokens.

        Prefill is compute-bound, so a padded token costs about as much as a real one, while an extra
        step costs roughly one pass over the weights. A 90-token prompt on chunk buckets 16/32/64/128 runs
        as 64 + 32 padded tokens (two steps) instead of 128: the split is taken when it saves at least
        the smallest chunk bucket's worth of tokens.
        """
        lengths = self.bucket_grid.spec.prefill_lengths
        padded = min((length for length in lengths if length >= n), default=n)
        below = [length for length in lengths if length < n]
        if padded == n or not below:
            return n
        first = below[-1]
        rest = min((length for length in lengths if length >= n - first), default=n - first)
        return first if padded - (first + rest) >= lengths[0] else n

    def _schedule_decode(self, sched: Schedule, decoding: list[Sequence]) -> None:
        speculates = self._speculates(decoding)
        for seq in decoding:  # oldest first: preemption victims are always later in this list
            if not speculates:
                seq.spec_token_ids = []
            if seq.status is SequenceStatus.RUNNING and self._reserve(seq, 1, sched):
                sched.decode_seqs.append(seq)
        room = self.step_budget.max_tokens - len(sched.decode_seqs)
        for seq in sched.decode_seqs:
            room -= self._fit_drafts(seq, room)
        if sched.decode_seqs and self.waiting:
            self.num_decode_steps_waited += 1

    def _speculates(self, decoding: list[Sequence]) -> bool:
        """Whether this step's decode rows verify drafts: a speculative grid, and no more decoding sequences than
        it makes room for (``disable_by_batch_size``: past it a draft costs about what a decoded token does)."""
        speculative = self.bucket_grid.speculative
        return speculative is not None and self.bucket_grid.has_mixed and len(decoding) <= speculative[1]

    def _fit_drafts(self, seq: Sequence, room: int) -> int:
        """Keeps the drafts of a decode row that fit the step's ``room`` tokens and the KV blocks free now (never
        preempting for a draft); allocates their blocks and returns their number."""
        drafts = seq.spec_token_ids[: max(room, 0)]
        if drafts and not self.block_manager.can_allocate(seq, 1 + len(drafts)):
            slack = len(seq.block_table) * self.block_manager.block_size - seq.num_computed_tokens - 1
            drafts = drafts[: max(slack, 0)]
            if drafts and not self.block_manager.can_allocate(seq, 1 + len(drafts)):
                drafts = []  # the blocks it would write are shared: their copies need free blocks
        if drafts:
            self.block_manager.allocate(seq, 1 + len(drafts))
        seq.spec_token_ids = drafts
        return len(drafts)

    # -- blocks and preemption ----------------------------------------------------------------------

    def _reserve(self, seq: Sequence, num_new_tokens: int, sched: Schedule) -> bool:
        """Allocate blocks for a running sequence, preempting the newest ones until it fits.

        Returns False when ``seq`` itself had to be preempted (it was the newest).
        """
        if self.block_manager.num_new_blocks(seq, num_new_tokens) == 0:
            return True  # the common decode case: the token fits the last block
        while not self.block_manager.can_allocate(seq, num_new_tokens):
            victim = max(self.running, key=self._order)
            self._preempt(victim, sched)
            if victim is seq:
                return False
        self.block_manager.allocate(seq, num_new_tokens)
        return True

    def _preempt(self, seq: Sequence, sched: Schedule) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        if self.policy == "fcfs":
            self.waiting.appendleft(seq)
        else:
            self._insert_waiting(seq)
        sched.preempted.append(seq)
