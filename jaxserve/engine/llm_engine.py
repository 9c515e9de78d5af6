"""LLMEngine: add_request / step / abort, the loop that LLM.generate and AsyncLLMEngine both drive.

Each `step()` asks the Scheduler for a Schedule, applies pending copy-on-write copies and new sampler slots on
the device, builds the step's inputs padded to the chosen bucket (`runner/input_batch.py`) and dispatches the
ModelRunner's precompiled executable; `Schedule.advance` then counts the rows as computed. With
`async_scheduling` (the default on TPU and GPU, not on CPU: `resolve_async_scheduling`) it does not wait for
that step: every sampling row gets a placeholder token at once, so the scheduler can plan the next step, and
the next step reads the real tokens on the device. While the device runs step N, the host reads step N-1's
tokens (and logprobs) and hands each to its request's group (`request_group.py`, `beam_search.py`), which
detokenizes, applies stop conditions and forks; the engine applies the forks and frees and returns a
RequestOutput for every request that advanced. A sequence that stops on a token the host had not yet seen was
already scheduled once more: that extra row's token is dropped. Beam search needs every step's logprobs before
it can pick the next beams, so while a beam search request runs, each step is read before the next is planned.
Structured outputs do not hold the batch back either. A constrained row's mask needs the token before it: when
step N+1 has a row whose grammar waits for step N's token, N+1 is dispatched at once taking only its argmax,
and once N's tokens are read (while N+1 runs) those rows' masks are filled and `ModelRunner.resample` samples
all of N+1's rows from its logits, on the device, before step N+2 reads its tokens.
With speculative decoding (`speculative_config`) the proposer drafts tokens for each decoding sequence from its
tokens so far (`jaxserve/speculative/`), the scheduler adds them to the sequence's row, the mixed step verifies
them on the device (`runner/spec_verify.py`), and `_take_verified` hands each row's accepted drafts and its last
token to the group, counting the drafts' K/V as computed. Drafts need the last step's tokens and a verifying
step's accepted count sets its rows' next positions, so such steps are read before the next is planned; with
async scheduling, steps run ahead only while more sequences run than get drafts (`disable_by_batch_size`)."""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

import jax
import numpy as np

from jaxserve.compilation.compile_cache import (
    CACHE_DIR_ENV,
    CacheManifest,
    CompileCounts,
    record_manifest,
    resolve_cache_dir,
    thread_compile_counts,
    use_persistent_cache,
)
from jaxserve.compilation.sizing import engine_bucket_grid
from jaxserve.compilation.warm_up import DEFAULT_COMPILE_THREADS, WarmUpReport, compile_buckets, use_compile_cache
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.kv_events_config import KVEventsConfig
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.schedule import Schedule
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sequence import PLACEHOLDER_TOKEN, Sequence
from jaxserve.core.step_budget import StepBudget
from jaxserve.distributed.multihost import distributed_init_requested, initialize_distributed
from jaxserve.distributed.sharding import engine_mesh
from jaxserve.engine.beam_search import BeamSearchGroup
from jaxserve.engine.kv_events import KVEventPublisher, binds, wire_event
from jaxserve.engine.logprobs import TokenTexts
from jaxserve.engine.request_checks import EngineLimits, check_beam_search_request, check_sampling_request
from jaxserve.engine.request_group import (
    EngineContext,
    GroupUpdate,
    RequestGroup,
    SampledToken,
    SamplingGroup,
)
from jaxserve.engine.step_trace import StepTrace
from jaxserve.logger import init_logger
from jaxserve.metrics.stat_logger import StatLogger
from jaxserve.metrics.stats import EngineStats, SchedulerStats, StatsSnapshot
from jaxserve.outputs import RequestOutput
from jaxserve.precision import resolve_engine_dtype
from jaxserve.quantization.weights import apply_quantization
from jaxserve.runner.input_batch import StepInputs, initial_token_counts, prepare_step_inputs, step_shape
from jaxserve.runner.model_runner import ModelRunner, StepOutput
from jaxserve.runner.sampler import FLAG_GRAMMAR, FLAG_LOGPROBS, FLAG_PROMPT_LOGPROBS, INT_COLUMNS, SamplingTensors
from jaxserve.runner.sampler_state import SlotTable
from jaxserve.runner.spec_verify import VerifyInputs
from jaxserve.runner.step_costs import measure_mixed_costs
from jaxserve.sampling_params import BeamSearchParams, SamplingParams
from jaxserve.speculative.draft_model import DraftModelProposer, build_draft_proposer, load_draft_model
from jaxserve.speculative.ngram import NgramProposer
from jaxserve.speculative.proposer import Proposer
from jaxserve.speculative.suffix import SuffixProposer
from jaxserve.weights import LoadedModel, load_model

logger = init_logger("jaxserve.engine.llm_engine")

_FLAGS = INT_COLUMNS.index("flags")


@dataclasses.dataclass
class InFlightStep:
    """A dispatched step whose results the host has not read yet."""

    output: StepOutput  # on the device
    flags: np.ndarray  # i32[S], the rows' sampling flags (which rows want logprobs)
    samples: list[tuple[RequestGroup, Sequence, int, int]]  # (group, seq, row, output index; -1: a beam)
    # (group, (index, column) of the row's first token in the step's prompt logprobs, first position, tokens)
    prompt_rows: list[tuple[RequestGroup, tuple[int, int], int, int]]
    rows_by_seq: dict[int, int]  # seq_id -> row, for feeding the tokens into the next step
    sampling: SamplingTensors | None = None  # the step's sampling inputs (host arrays)
    # samples of constrained rows whose mask waited for the previous step's token: the step only took its
    # argmax, and samples for real once the masks are known (see LLMEngine._resample)
    masks_pending: list[tuple[RequestGroup, Sequence, int, int]] = dataclasses.field(default_factory=list)
    trace: dict | None = None  # the step's record in the step trace (JAXSERVE_STEP_TRACE), closed in _complete
    verify: VerifyInputs | None = None  # a verifying step's sample positions and drafts (host arrays)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, *, warm_up: bool = True):
        self.config = config
        if distributed_init_requested(config.distributed_init):
            initialize_distributed(config.coordinator_address, config.num_processes, config.process_id)
        # The persistent compile cache's directory (absolute; None: disabled), set before anything compiles
        # so that every executable is cached.
        self.compile_cache_dir: Path | None = use_persistent_cache(resolve_cache_dir(config.compile_cache_dir))
        if self.compile_cache_dir is None:
            logger.info("persistent compile cache: disabled (compile_cache_dir='' or %s='')", CACHE_DIR_ENV)
        else:
            logger.info("persistent compile cache: %s", self.compile_cache_dir)
        self.mesh = engine_mesh(config.tensor_parallel_size, config.data_parallel_rank)
        self.config = config = resolve_engine_dtype(config, self.mesh.devices.flat[0])
        loaded = loaded or load_model(config.model, config.dtype, mesh=self.mesh, quantization=config.quantization)
        model_config, params = apply_quantization(loaded.config, loaded.params, config.quantization)
        loaded = dataclasses.replace(loaded, config=model_config, params=params)
        self.model_config = loaded.config
        self.model_path = loaded.path
        self.tokenizer = loaded.tokenizer
        spec = config.speculative_config
        draft = None
        if spec is not None and spec.method == "draft_model":
            draft = load_draft_model(spec.model, loaded.config, config.dtype, self.mesh)
        self.grid = engine_bucket_grid(config, loaded.config, loaded.params, jax.default_backend(), self.mesh,
                                       draft=None if draft is None else (draft.config, draft.params))
        self.block_size, num_blocks = self.grid.block_size, self.grid.num_blocks
        self.block_manager = BlockManager(num_blocks, self.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.kv_event_publisher = self._kv_event_publisher(config.kv_events_config)
        self.max_model_len = self.grid.max_model_len
        self.scheduler = Scheduler(
            self.block_manager, self.grid,
            max_num_seqs=self.grid.max_num_seqs, max_num_batched_tokens=self.grid.max_num_batched_tokens,
            **({} if config.waiting_served_ratio is None else {"waiting_served_ratio": config.waiting_served_ratio}),
        )
        logger.info("%s", _scheduling_summary(self.scheduler))
        self.runner = ModelRunner.for_engine(loaded.config, loaded.params, config, self.grid, self.mesh)
        self._in_flight: InFlightStep | None = None
        self.proposer = make_proposer(config, self.grid, draft, self.mesh)
        self.warm_up_report: WarmUpReport | None = None
        self.leading_host = None  # multi-host serving, host 0: the followers its runner calls reach (serving_hosts)
        self.async_scheduling = resolve_async_scheduling(config.async_scheduling, self.mesh.devices.flat[0].platform,
                                                         speculative=self.proposer is not None)
        self._num_sync_groups = 0  # requests that need each step's results before the next is planned
        self.requests: dict[str, RequestGroup] = {}
        self.stats = EngineStats()
        self.stat_logger = None if config.disable_log_stats else StatLogger(self.make_stats())
        self.step_trace = StepTrace.from_env()
        self._rng = random.Random(config.seed)
        self.eos_token_ids = set(loaded.config.eos_token_id)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.slots = SlotTable(self.grid.max_num_seqs)
        self._slot_copies: list[tuple[int, int]] = []  # (parent slot, child slot) of forks not yet copied
        self.context = EngineContext(
            tokenizer=self.tokenizer, texts=TokenTexts(self.tokenizer), eos_token_ids=frozenset(self.eos_token_ids),
            max_model_len=self.max_model_len, vocab_size=loaded.config.vocab_size,
        )
        self.limits = EngineLimits(
            vocab_size=loaded.config.vocab_size, max_logprobs=config.max_logprobs,
            max_num_seqs=self.grid.max_num_seqs, num_kv_blocks=num_blocks, block_size=self.block_size,
        )
        if warm_up:
            self.warm_up()

    # ----- construction -------------------------------------------------------------------------
    def warm_up(self, num_threads: int = DEFAULT_COMPILE_THREADS) -> WarmUpReport:
        """Compiles (or loads from the compile cache) every feasible bucket and the fork executables;
        after this nothing compiles."""
        logger.info("%s", self.grid.format_table())
        check = manifest = None
        cache_dir = use_persistent_cache(self.compile_cache_dir)  # again: another engine may have moved it
        if cache_dir is not None:
            manifest = CacheManifest.current(
                self.model_config, self.config.dtype, self.grid, self.runner.backend.name, self.mesh.size,
                max_logprobs=self.config.max_logprobs, kv_cache_dtype=self.config.kv_cache_dtype,
                model=str(self.model_path), written_by="engine warm-up",
            )
            check = use_compile_cache(self.runner, cache_dir, manifest)
        self.runner.compile_helpers()
        report = compile_buckets(self.runner, self.grid.buckets, num_threads=num_threads, cache_dir=cache_dir,
                                 cache_check=check)
        if manifest is not None and not check.ok:
            record_manifest(cache_dir, manifest)  # every bucket of this configuration is in the cache now
        logger.info("warm-up: %s", report.summary())
        if isinstance(self.proposer, DraftModelProposer):
            draft_report = compile_buckets(self.proposer.runner, self.proposer.buckets, num_threads=num_threads,
                                           cache_dir=cache_dir)
            logger.info("warm-up of the draft model: %s", draft_report.summary())
        self.warm_up_report = report
        self._measure_step_costs()
        return report

    def _measure_step_costs(self) -> None:
        """With a latency target, times the mixed buckets and gives the scheduler the budget they allow."""
        if self.config.max_itl_ms is None or not self.grid.has_mixed:
            return
        costs = measure_mixed_costs(self.runner, self.grid.mixed_buckets)
        logger.info("%s", costs.format_table())
        budget = StepBudget(self.grid, self.scheduler.max_num_batched_tokens, self.config.max_itl_ms, costs)
        self.scheduler.step_budget = budget
        logger.info("step budget: %s", budget.describe())

    # ----- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: str | dict | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        raise TypeError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt, params: SamplingParams | BeamSearchParams | None = None) -> None:
        """Queues a request; BeamSearchParams make it a beam search (one final output, beams best first)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt must contain at least one token")
        seed = self._rng.getrandbits(32)
        if isinstance(params, BeamSearchParams):
            if self.proposer is not None:
                raise ValueError("beam search is not supported with speculative decoding (speculative_config)")
            check_beam_search_request(params, len(token_ids), self.limits)
            self.grid.check_request(len(token_ids), params.max_tokens)
            group = BeamSearchGroup(request_id, text, token_ids, params, seed, self.context)
        elif isinstance(params, SamplingParams):
            check_sampling_request(params, self.limits)
            self.grid.check_request(len(token_ids), params.max_tokens or self.max_model_len - len(token_ids))
            seed = params.seed if params.seed is not None else seed
            group = SamplingGroup(request_id, text, token_ids, params, seed, self.context)
        else:
            raise TypeError(f"params must be SamplingParams or BeamSearchParams, got {type(params).__name__}")
        self.requests[request_id] = group
        self._num_sync_groups += group.needs_host_sync
        self.scheduler.add(group.seq)
        self.stats.num_prompt_tokens += len(token_ids)

    def abort_all_requests(self) -> list[str]:
        """Ends every request (after a failed step: their state is unknown); their ids."""
        request_ids = list(self.requests)
        for request_id in request_ids:
            self.abort_request(request_id)
        return request_ids

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ends a request at once; its tokens still on the device are dropped."""
        group = self.requests.get(request_id)
        if group is None:
            return None
        for seq in self.scheduler.abort(request_id):
            self._release(seq)
        group.abort()
        output = group.make_output()
        self._remove(group)
        return output

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def make_stats(self) -> StatsSnapshot:
        """The engine's counters and its scheduler's state now, copied: what the stats line and /metrics read."""
        prefix_cache = self.block_manager.prefix_cache_stats
        scheduler = SchedulerStats(
            num_running_reqs=self.scheduler.num_running_requests, num_waiting_reqs=self.scheduler.num_waiting_requests,
            kv_cache_usage=self.block_manager.usage, prefix_cache_queries=prefix_cache.queries,
            prefix_cache_hits=prefix_cache.hits,
        )
        per_position = list(self.stats.spec_accepted_per_position)
        return StatsSnapshot(scheduler, dataclasses.replace(self.stats, spec_accepted_per_position=per_position))

    def _kv_event_publisher(self, events: KVEventsConfig | None) -> KVEventPublisher | None:
        """The publisher of the prefix cache's events (`kv_events_config`), the block manager recording them."""
        if events is None or not events.publishes or jax.process_index() != 0:
            return None  # multi-host: host 0 schedules, so only its block manager has events
        if self.block_manager.prefix_cache is None:
            logger.warning("kv_events_config: prefix caching is off, so no KV cache events will be published")
        self.block_manager.cache_events = []
        rank = self.config.data_parallel_rank
        publisher = KVEventPublisher(events.for_rank(rank), data_parallel_rank=rank)
        how = "published at" if binds(events.endpoint) else "sent to a subscriber that binds"
        logger.info("KV cache events: %s %s (topic %r)", how, publisher.endpoint(), events.topic)
        return publisher

    # ----- one iteration ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and dispatches one step, then returns the outputs of the step before it (or of
        this one, without async scheduling)."""
        outputs = []
        if self._in_flight is not None and self._num_sync_groups:
            outputs += self._complete(self._in_flight)  # beams pick their next tokens before scheduling
            self._in_flight = None
        if self.proposer is not None and self._in_flight is None:
            self._propose_drafts()  # from every sequence's real last token: no step is unread
        schedule = self.scheduler.schedule()
        self.stats.num_preemptions += len(schedule.preempted)
        for seq in schedule.preempted:
            self._release(seq)  # a recompute starts at position 0 in a fresh slot
        outputs += self._finish_ignored(schedule.ignored)
        launched = None if schedule.is_idle else self._launch(schedule)
        if self._in_flight is not None:
            outputs += self._complete(self._in_flight)
        if launched is not None and launched.masks_pending:
            self._resample(launched)
        self._in_flight = launched
        if launched is not None and not self._plans_ahead(launched):
            outputs += self._complete(launched)
            self._in_flight = None
        self._publish_cache_events()  # the blocks this step stored and evicted: one batch
        if self.stat_logger is not None and self.stat_logger.is_due():
            self.stat_logger.log(self.make_stats())
        return outputs

    def close(self) -> None:
        """Stops what runs beside the steps: the KV event publisher's thread, once it has sent what is queued."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()
            self.kv_event_publisher = None

    def reset_prefix_cache(self) -> int:
        """Drops every cached KV block no running request holds (vLLM's `reset_prefix_cache`; the server's
        /reset_prefix_cache and /flush_cache): later requests compute their prefixes anew. The number dropped."""
        dropped = self.block_manager.reset_prefix_cache()
        self._publish_cache_events()
        logger.info("prefix cache reset: %d cached blocks dropped", dropped)
        return dropped

    def _publish_cache_events(self) -> None:
        if self.kv_event_publisher is not None:
            events = self.block_manager.take_cache_events()
            self.kv_event_publisher.publish([wire_event(event, self.block_size) for event in events])

    def _plans_ahead(self, launched: InFlightStep) -> bool:
        """Whether the next step is planned before ``launched`` is read: with async scheduling, unless drafts need
        its tokens (speculative decoding: it verifies drafts, whose accepted number sets the next rows' positions,
        or few enough sequences run that the next step may draft from their last tokens)."""
        if not self.async_scheduling:
            return False
        if self.proposer is None:
            return True
        return launched.verify is None and len(self.scheduler.running) > self.grid.speculative[1]

    def _check_no_compile(self, before: CompileCounts, schedule: Schedule) -> None:
        """Counts executables built during a step (a bug: warm-up covers every bucket); strict mode raises."""
        num_compiles = (thread_compile_counts() - before).backend_compiles
        if not num_compiles:
            return
        self.stats.num_compiles_after_warm_up += num_compiles
        message = (
            f"{num_compiles} XLA compilation(s) after warm-up, during a step on bucket {schedule.bucket}: "
            "warm-up did not cover this shape"
        )
        if self.config.strict_no_compile:
            raise RuntimeError(f"strict_no_compile: {message}")
        logger.warning("%s", message)

    def _finish_ignored(self, ignored: list[Sequence]) -> list[RequestOutput]:
        """Sequences the scheduler could never run (they reached max_model_len) end with "length"."""
        groups = {}
        for seq in ignored:
            self._release(seq)
            group = self.requests[seq.request_id]
            group.on_ignored(seq)
            groups[group.request_id] = group
        return self._report(groups.values())

    def _launch(self, schedule: Schedule) -> InFlightStep:
        """Dispatches the step and advances host state as if its tokens were known (placeholders)."""
        started = time.time() if self.step_trace is not None else 0.0
        rows = schedule.rows
        self._sync_device_state(rows)
        compiles_before = thread_compile_counts()
        if schedule.num_draft_tokens:
            self.proposer.fill_drafts(rows)  # a draft model's tokens, now that the rows' blocks are allocated
        inputs = self._step_inputs(schedule, rows)
        sampling = inputs.sampling
        masks_wait = {i for i, (seq, start, num_tokens) in enumerate(rows)
                      if start + num_tokens == seq.num_tokens and self.requests[seq.request_id].mask_waits(seq)}
        if masks_wait:  # sampled in _resample, once the masks are known
            inputs = dataclasses.replace(inputs, sampling=sampling.argmax_only())
        prev = self._in_flight.output.tokens if self._in_flight is not None else None
        output = self.runner.execute(schedule.bucket, inputs, prev)
        self._check_no_compile(compiles_before, schedule)
        step = InFlightStep(output, sampling.ints[:, _FLAGS], [], [], {}, sampling, verify=inputs.verify)
        self._advance(schedule, rows, inputs, step, masks_wait)
        self._count_step(schedule)
        if self.step_trace is not None:
            step.trace = self.step_trace.launched(schedule, started, self.scheduler.num_waiting_requests,
                                                  self.scheduler.num_running_requests)
        return step

    def _step_inputs(self, schedule: Schedule, rows: list[tuple[Sequence, int, int]]) -> StepInputs:
        """The step's padded device inputs, with each row's sampling values from its request group."""
        sampling_rows = [self.requests[seq.request_id].sampling_row(seq, start, num_tokens, self.slots.get(seq.seq_id))
                         for seq, start, num_tokens in rows]
        previous_rows = self._in_flight.rows_by_seq if self._in_flight is not None else {}
        return prepare_step_inputs(rows, step_shape(schedule.bucket, self.block_size), sampling_rows, previous_rows,
                                   self.slots.no_slot, self.model_config.vocab_size)

    def _advance(self, schedule: Schedule, rows: list[tuple[Sequence, int, int]], inputs: StepInputs,
                 step: InFlightStep, masks_wait: set[int]) -> None:
        """The dispatched step's rows count as computed; each row that samples announces its token to its group
        (a placeholder) and is recorded in ``step`` for `_complete`."""
        sampling_rows = set(schedule.advance())
        launched: dict[str, RequestGroup] = {}
        for row, (seq, start, num_tokens) in enumerate(rows):
            self.block_manager.cache_blocks(seq)  # later steps that hit them run after this one on the device
            group = self.requests[seq.request_id]
            if step.flags[row] & FLAG_PROMPT_LOGPROBS:
                first = (0, int(inputs.query_starts[row])) if inputs.query_starts is not None else (row, 0)
                step.prompt_rows.append((group, first, start, num_tokens))
            if row not in sampling_rows:
                continue  # a prefill chunk that did not reach the end of the prompt samples nothing
            index = group.on_launch(seq)
            step.samples.append((group, seq, row, index))
            if row in masks_wait:
                step.masks_pending.append((group, seq, row, index))
            step.rows_by_seq[seq.seq_id] = row
            launched[group.request_id] = group
        for group in launched.values():
            self._apply(group.take_update())  # forks of n > 1, sequences at their length limit

    def _resample(self, step: InFlightStep) -> None:
        """The step just dispatched only took its argmax: some of its constrained rows' grammars waited for the
        previous step's tokens, which were read since. Those rows' masks are filled now, and every row of the
        step is sampled from its logits (`ModelRunner.resample`), once: the sampling costs what it would have."""
        ints, allowed = step.sampling.ints.copy(), step.sampling.allowed.copy()
        for group, seq, row, index in step.masks_pending:
            mask = group.grammar_mask(seq, index) if self.requests.get(group.request_id) is group else None
            if mask is None:
                continue  # stopped (or aborted) on the previous token: this row's token is dropped
            allowed[row] = mask
            ints[row, _FLAGS] |= FLAG_GRAMMAR
            self.stats.num_late_masks += 1
        step.output = self.runner.resample(step.output, SamplingTensors(step.sampling.floats, ints, allowed))
        self.stats.num_late_sampled_steps += 1

    def _sync_device_state(self, rows: list[tuple[Sequence, int, int]]) -> None:
        """Before the step: copy-on-write copies (KV blocks, forked sampler slots), then new slots' reset."""
        writes = []
        for seq, start, _ in rows:
            group = self.requests[seq.request_id]
            if not group.needs_slot() or self.slots.get(seq.seq_id) is not None:
                continue
            # the whole prompt's mask; a slot taken past the prompt (prefix cache hit) the counts up to start
            counts = initial_token_counts(seq, start, self.model_config.vocab_size)
            writes.append((self.slots.assign(seq.seq_id), (*group.slot_rows(), *counts)))
        block_copies, slot_copies = self.block_manager.take_pending_copies(), self._slot_copies
        self._slot_copies = []
        if block_copies or slot_copies:
            self.runner.copy_blocks(block_copies, slot_copies)
        for slot, rows_of_slot in writes:
            self.runner.write_slot(slot, *rows_of_slot)

    def _count_step(self, schedule: Schedule) -> None:
        self.stats.num_steps += 1
        if schedule.is_mixed:
            self.stats.num_mixed_steps += 1
        elif schedule.is_prefill:
            self.stats.num_prefill_steps += 1
        else:
            self.stats.num_decode_steps += 1
        self.stats.num_real_tokens += schedule.num_batched_tokens
        self.stats.num_prefill_tokens += schedule.num_prefill_tokens
        self.stats.num_padded_tokens += schedule.num_padded_tokens

    def _complete(self, step: InFlightStep) -> list[RequestOutput]:
        """Reads a dispatched step's results (waits for the device) and hands them to their groups."""
        tokens = np.asarray(step.output.tokens)
        if step.trace is not None:
            self.step_trace.completed(step.trace)
        logprobs = _host(step.output.logprobs) if np.any(step.flags & FLAG_LOGPROBS) else None
        prompt_logprobs = _host(step.output.prompt_logprobs) if step.prompt_rows else None
        for group, (index, column), start, num_tokens in step.prompt_rows:
            if self.requests.get(group.request_id) is group:
                group.add_prompt_logprobs(start, num_tokens, [x[index, column:] for x in prompt_logprobs])
        touched: dict[str, RequestGroup] = {}
        num_accepted = None if step.output.num_accepted is None else np.asarray(step.output.num_accepted)
        for group, seq, row, index in step.samples:
            if self.requests.get(group.request_id) is not group:
                continue  # aborted: this row's token is dropped
            if num_accepted is None:
                taken = int(group.on_sample(seq, index, _sampled(tokens, logprobs, row)))
            else:
                taken = self._take_verified(step, group, seq, row, index, int(num_accepted[row]), tokens, logprobs)
            if taken:
                self.stats.num_generation_tokens += taken
                touched[group.request_id] = group
        for group in touched.values():
            group.after_step()
            self._apply(group.take_update())
        return self._report(touched.values())

    def _take_verified(self, step: InFlightStep, group: RequestGroup, seq: Sequence, row: int, index: int,
                       num_accepted: int, tokens: np.ndarray, logprobs) -> int:
        """A verifying step's row: its accepted drafts and its last token go to its group, in order, until one
        stops the sequence; the accepted drafts' K/V count as computed. Returns the tokens taken."""
        num_drafts = len(seq.spec_token_ids)
        seq.spec_token_ids = []
        seq.num_computed_tokens += num_accepted
        positions = step.verify.row_positions[row, : num_accepted + 1]
        kept = [*step.verify.draft[positions[:-1]].tolist(), int(tokens[row])]  # the accepted drafts, then its token
        samples = [_sampled_at(token, logprobs, position) for token, position in zip(kept, positions, strict=True)]
        self.stats.count_drafts(num_drafts, num_accepted)
        return group.on_sample_tokens(seq, index, samples)

    def _propose_drafts(self) -> None:
        """Before scheduling: drafts for every decoding sequence, when no more decode than the grid verifies."""
        decoding = [seq for seq in self.scheduler.running if seq.num_uncomputed_tokens == 1]
        if len(decoding) > self.grid.speculative[1]:
            return
        for seq in decoding:
            max_drafts = self.requests[seq.request_id].max_drafts(seq)
            seq.spec_token_ids = (self.proposer.propose_for(seq.seq_id, seq.all_token_ids, max_drafts)
                                  if max_drafts > 0 else [])

    def _apply(self, update: GroupUpdate) -> None:
        """Forks first (they share blocks that a finished parent is about to release), then frees."""
        for parent, child in update.forks:
            self.block_manager.fork(parent, child)
            self.scheduler.add_forked(child)
            parent_slot = self.slots.get(parent.seq_id)
            if parent_slot is not None:
                self._slot_copies.append((parent_slot, self.slots.assign(child.seq_id)))
        for seq in update.finished:
            self.scheduler.finish(seq)
            self._release(seq, finished=True)

    def _release(self, seq: Sequence, *, finished: bool = False) -> None:
        """A sequence that finished, was aborted or preempted gives back its sampler slot and its proposer state
        (a finished one's output may stay with the proposer: suffix decoding's responses)."""
        self.slots.release(seq.seq_id)
        if self.proposer is None:
            return
        if finished:
            self.proposer.record_finished(seq.seq_id, _read_tokens(seq.output_token_ids))
        else:
            self.proposer.release(seq.seq_id)

    def _report(self, groups) -> list[RequestOutput]:
        outputs = []
        for group in list(groups):
            output = group.make_output()
            if group.is_finished:
                self._remove(group)
            if output is not None:
                outputs.append(output)
        return outputs

    def _remove(self, group: RequestGroup) -> None:
        del self.requests[group.request_id]
        self._num_sync_groups -= group.needs_host_sync


def resolve_async_scheduling(requested: bool | None, platform: str, *, speculative: bool = False) -> bool:
    """Whether steps are planned ahead: as requested, else (None) on where a device runs the steps beside the
    host (TPU, GPU) and off on CPU, as vLLM's CPU backend. On CPU the host's planning takes the cores the step
    runs on, so planning ahead saves nothing, and a request arriving during step N would wait for step N+1,
    already planned without it (docs/benchmarks/serving-load.md measures both). With speculative decoding only
    steps past ``disable_by_batch_size`` are planned ahead: drafts come from the last step's tokens
    (`LLMEngine._plans_ahead`)."""
    resolved = platform != "cpu" if requested is None else requested
    logger.info("async scheduling: %s%s%s", "on" if resolved else "off", " (auto)" if requested is None else "",
                " while no sequence drafts (speculative decoding)" if resolved and speculative else "")
    return resolved


def make_proposer(config: EngineConfig, grid, draft: LoadedModel | None, mesh) -> Proposer | None:
    """The engine's draft proposer (None: no speculative decoding); the grid must have mixed buckets to verify in.
    ``draft``: the draft model of method "draft_model"."""
    spec = config.speculative_config
    if spec is None:
        return None
    if not grid.has_mixed:
        raise ValueError(f"speculative decoding verifies drafts in mixed steps: {grid.spec.source} has no [mixed] "
                         "buckets")
    logger.info("speculative decoding: %s%s, up to %d drafts per row, while at most %d sequences decode", spec.method,
                f" ({spec.model})" if spec.model else "", spec.num_speculative_tokens, spec.disable_by_batch_size)
    if spec.method == "draft_model":
        return build_draft_proposer(draft, config, grid, mesh)
    if spec.method == "suffix":
        return SuffixProposer(spec.num_speculative_tokens, spec.suffix_decoding_max_tree_depth,
                              spec.suffix_decoding_max_cached_requests, spec.suffix_decoding_max_spec_factor,
                              spec.suffix_decoding_min_token_prob)
    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)


def _scheduling_summary(scheduler: Scheduler) -> str:
    """The start-up line that says how steps are formed and their token budget."""
    grid = scheduler.bucket_grid
    if not grid.has_mixed:
        return (f"scheduling: prefill-or-decode steps (no [mixed] buckets in {grid.spec.source}), "
                f"max_num_batched_tokens={scheduler.max_num_batched_tokens}")
    return (f"scheduling: mixed steps (decode rows first, then prefill chunks) of up to "
            f"{scheduler.step_budget.untargeted_tokens} tokens and {grid.max_mixed_batch_size} rows; prefill-only "
            f"steps up to max_num_batched_tokens={scheduler.max_num_batched_tokens}")


def _read_tokens(token_ids: list[int]) -> list[int]:
    """``token_ids`` without the placeholders at its end: a sequence that reaches its length limit finishes when
    its last step is dispatched, before that step's token is read."""
    end = len(token_ids)
    while end and token_ids[end - 1] == PLACEHOLDER_TOKEN:
        end -= 1
    return token_ids[:end]


def _host(logprobs) -> tuple[np.ndarray, ...]:
    """(token logprob, rank, top ids, top logprobs) as numpy arrays."""
    return tuple(np.asarray(x) for x in (logprobs.token_logprob, logprobs.token_rank, logprobs.top_ids,
                                         logprobs.top_logprobs))


def _sampled(tokens: np.ndarray, logprobs: tuple[np.ndarray, ...] | None, i: int) -> SampledToken:
    return _sampled_at(int(tokens[i]), logprobs, i)


def _sampled_at(token: int, logprobs: tuple[np.ndarray, ...] | None, i: int) -> SampledToken:
    """``token`` with the logprobs at index ``i`` (a row, or a verifying step's sample position)."""
    if logprobs is None:
        return SampledToken(token)
    token_logprob, rank, top_ids, top_logprobs = logprobs
    return SampledToken(token, float(token_logprob[i]), int(rank[i]), top_ids[i], top_logprobs[i])
