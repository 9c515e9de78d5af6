"""LLMEngine: add_request / step / abort, the loop that LLM.generate and AsyncLLMEngine both drive.

The engine is built by `engine_builder.py` (model, bucket grid, scheduler, step runner, warm-up). Each `step()`
asks the Scheduler for a Schedule and hands it, with each row's request group, to the step runner
(`runner/step_runner.py`), which owns everything device-side: sampler slots, copy-on-write copies, the step's
padded inputs and its dispatch; `Schedule.advance` then counts the rows as computed. With `async_scheduling` (the
default on TPU and GPU, not on CPU: `resolve_async_scheduling`) it does not wait for that step: every sampling
row gets a placeholder token at once, so the scheduler can plan the next step, and the next step reads the real
tokens on the device. While the device runs step N, the host collects step N-1's results (tokens, logprobs) and
hands each to its request's group (`request_group.py`, `beam_search.py`), which
detokenizes, applies stop conditions and forks; the engine applies the forks and frees and returns a
RequestOutput for every request that advanced. A sequence that stops on a token the host had not yet seen was
already scheduled once more: that extra row's token is dropped. Beam search needs every step's logprobs before
it can pick the next beams, so while a beam search request runs, each step is read before the next is planned.
Structured outputs do not hold the batch back either. A constrained row's mask needs the token before it: when
step N+1 has a row whose grammar waits for step N's token, N+1 is dispatched at once taking only its argmax,
and once N's tokens are read (while N+1 runs) those rows' masks are filled and `StepRunner.resample` samples
all of N+1's rows from its logits, on the device, before step N+2 reads its tokens.
With speculative decoding (`speculative_config`) the proposer drafts tokens for each decoding sequence from its
tokens so far (`jaxserve/speculative/`), the scheduler adds them to the sequence's row, the mixed step verifies
them on the device (`runner/spec_verify.py`), and `_take_verified` hands each row's accepted drafts and its last
token (`StepResult.samples`) to the group, counting the drafts' K/V as computed. Drafts need the last step's tokens
and a verifying step's accepted count sets its rows' next positions, so such steps are read before the next is
planned; with async scheduling, steps run ahead only while more sequences run than get drafts
(`disable_by_batch_size`)."""

from __future__ import annotations

import dataclasses
import random
import time

from jaxserve.compilation.compile_cache import CompileCounts, num_backend_compiles, thread_compile_counts
from jaxserve.compilation.warm_up import DEFAULT_COMPILE_THREADS, WarmUpReport
from jaxserve.config.engine_config import EngineConfig
from jaxserve.core.schedule import Schedule
from jaxserve.core.sequence import PLACEHOLDER_TOKEN, Sequence
from jaxserve.engine.beam_search import BeamSearchGroup
from jaxserve.engine.engine_builder import EngineParts, build_engine_parts, resolve_async_scheduling, warm_up_engine
from jaxserve.engine.kv_events import wire_event
from jaxserve.engine.logprobs import TokenTexts
from jaxserve.engine.request_checks import (
    EngineLimits,
    check_beam_search_request,
    check_priority,
    check_sampling_request,
    truncated_prompt,
)
from jaxserve.engine.request_group import EngineContext, GroupUpdate, RequestGroup, SamplingGroup
from jaxserve.engine.step_trace import StepTrace
from jaxserve.logger import init_logger
from jaxserve.metrics.stat_logger import StatLogger
from jaxserve.metrics.stats import EngineStats, SchedulerStats, StatsSnapshot
from jaxserve.outputs import RequestOutput
from jaxserve.runner.step_runner import LaunchedStep, StepResult
from jaxserve.sampling_params import BeamSearchParams, SamplingParams
from jaxserve.weights import LoadedModel

logger = init_logger("jaxserve.engine.llm_engine")


@dataclasses.dataclass
class InFlightStep:
    """A dispatched step whose results the host has not read yet: the runner's record and whose rows they are."""

    launched: LaunchedStep  # on the device
    samples: list[tuple[RequestGroup, Sequence, int, int]]  # (group, seq, row, output index; -1: a beam)
    prompt_rows: list[tuple[RequestGroup, int, int, int]]  # (group, row, first position, tokens): prompt logprobs
    trace: dict | None = None  # the step's record in the step trace (JAXSERVE_STEP_TRACE), closed in _complete

    @property
    def masks_pending(self) -> list[tuple[RequestGroup, Sequence, int, int]]:
        """The samples of constrained rows whose mask waited for the previous step's token: the step only took
        their argmax, and samples for real once the masks are known (see LLMEngine._resample)."""
        return [sample for sample in self.samples if sample[2] in self.launched.late_mask_rows]


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, *, warm_up: bool = True):
        self.parts = build_engine_parts(config, loaded)
        self._take_parts(self.parts)
        self.async_scheduling = resolve_async_scheduling(self.config.async_scheduling,
                                                         self.mesh.devices.flat[0].platform,
                                                         speculative=self.proposer is not None)
        self._in_flight: InFlightStep | None = None
        self.warm_up_report: WarmUpReport | None = None
        self.leading_host = None  # multi-host serving, host 0: its followers (`replication/serving_hosts.py`)
        self._num_sync_groups = 0  # requests that need each step's results before the next is planned
        self.requests: dict[str, RequestGroup] = {}
        self.stats = EngineStats()
        self.stat_logger = None if self.config.disable_log_stats else StatLogger(self.make_stats())
        self.step_trace = StepTrace.from_env()
        self._rng = random.Random(self.config.seed)
        self.eos_token_ids = set(self.model_config.eos_token_id)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.context, self.limits = self._request_context()
        if warm_up:
            self.warm_up()

    def _take_parts(self, parts: EngineParts) -> None:
        self.config, self.compile_cache_dir, self.mesh = parts.config, parts.compile_cache_dir, parts.mesh
        self.model_config, self.model_path, self.tokenizer = parts.model.config, parts.model.path, parts.model.tokenizer
        self.grid, self.block_manager, self.scheduler = parts.grid, parts.block_manager, parts.scheduler
        self.step_runner, self.proposer = parts.runner, parts.proposer
        self.kv_event_publisher = parts.kv_event_publisher
        self.block_size, self.max_model_len = self.grid.block_size, self.grid.max_model_len

    def _request_context(self) -> tuple[EngineContext, EngineLimits]:
        """What request groups read of the engine, and the limits requests are checked against."""
        vocab_size = self.model_config.vocab_size
        context = EngineContext(
            tokenizer=self.tokenizer, texts=TokenTexts(self.tokenizer), eos_token_ids=frozenset(self.eos_token_ids),
            max_model_len=self.max_model_len, vocab_size=vocab_size,
            structured_outputs_config=self.config.structured_outputs_config,
        )
        limits = EngineLimits(
            vocab_size=vocab_size, max_logprobs=self.config.max_logprobs, max_num_seqs=self.grid.max_num_seqs,
            num_kv_blocks=self.grid.num_blocks, block_size=self.block_size,
            scheduling_policy=self.config.scheduling_policy,
        )
        return context, limits

    @property
    def runner(self):
        """The `ModelRunner` whose executables run the steps (the step runner's device programs)."""
        return self.step_runner.model

    def warm_up(self, num_threads: int = DEFAULT_COMPILE_THREADS) -> WarmUpReport:
        """Compiles (or loads from the compile cache) every feasible bucket and the fork executables;
        after this nothing compiles."""
        self.warm_up_report = warm_up_engine(self.parts, num_threads)
        return self.warm_up_report

    # ----- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: str | dict | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        raise TypeError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt, params: SamplingParams | BeamSearchParams | None = None,
                    priority: int = 0) -> None:
        """Queues a request; BeamSearchParams make it a beam search (one final output, beams best first).
        ``priority``: under the priority scheduling policy, lower values are scheduled first (vLLM's)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_priority(priority, self.limits)
        text, token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt must contain at least one token")
        seed = self._rng.getrandbits(32)
        if isinstance(params, BeamSearchParams):
            if self.proposer is not None:
                raise ValueError("beam search is not supported with speculative decoding (speculative_config)")
            check_beam_search_request(params, len(token_ids), self.limits)
            self.grid.check_request(len(token_ids), params.max_tokens)
            seed = params.seed if params.seed is not None else seed
            group = BeamSearchGroup(request_id, text, token_ids, params, seed, self.context, priority)
        elif isinstance(params, SamplingParams):
            check_sampling_request(params, self.limits)
            kept = truncated_prompt(token_ids, params.truncate_prompt_tokens, self.max_model_len)
            if len(kept) < len(token_ids):  # the prompt is what the model sees
                text, token_ids = self.tokenizer.decode(kept), kept
            self.grid.check_request(len(token_ids), params.max_tokens or self.max_model_len - len(token_ids))
            seed = params.seed if params.seed is not None else seed
            group = SamplingGroup(request_id, text, token_ids, params, seed, self.context, priority)
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
        engine = dataclasses.replace(self.stats, spec_accepted_per_position=per_position,
                                     num_buckets=self.grid.num_executables, num_buckets_ready=self.grid.num_ready)
        return StatsSnapshot(scheduler, engine)

    # ----- one iteration ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and dispatches one step, then returns the outputs of the step before it (or of
        this one, without async scheduling)."""
        outputs = []
        self.parts.background.hand_over()  # buckets built in the background serve from this step on
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

    def serving_compiles(self) -> int:
        """XLA compilations in this process but the background compiler's: anything the step path compiled."""
        return num_backend_compiles() - self.parts.background.backend_compiles

    def close(self) -> None:
        """Stops what runs beside the steps: the background compiler (after the bucket it is building) and the KV
        event publisher's thread, once it has sent what is queued."""
        self.parts.background.stop()
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

    def _plans_ahead(self, step: InFlightStep) -> bool:
        """Whether the next step is planned before ``step`` is read: with async scheduling, unless drafts need
        its tokens (speculative decoding: it verifies drafts, whose accepted number sets the next rows' positions,
        or few enough sequences run that the next step may draft from their last tokens)."""
        if not self.async_scheduling:
            return False
        if self.proposer is None:
            return True
        return not step.launched.verifies and len(self.scheduler.running) > self.grid.speculative[1]

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
        compiles_before = thread_compile_counts()
        if schedule.num_draft_tokens:
            self.proposer.fill_drafts(rows)  # a draft model's tokens, now that the rows' blocks are allocated
        requests = [self.requests[seq.request_id] for seq, _, _ in rows]
        launched = self.step_runner.launch(schedule.bucket, rows, requests, self.block_manager.take_pending_copies())
        self._check_no_compile(compiles_before, schedule)
        step = InFlightStep(launched, [], [])
        self._advance(schedule, rows, step)
        self._count_step(schedule)
        if self.step_trace is not None:
            step.trace = self.step_trace.launched(schedule, started, self.scheduler.num_waiting_requests,
                                                  self.scheduler.num_running_requests)
        return step

    def _advance(self, schedule: Schedule, rows: list[tuple[Sequence, int, int]], step: InFlightStep) -> None:
        """The dispatched step's rows (``schedule``'s, as planned) count as computed; each row that samples
        announces its token to its group (a placeholder) and is recorded in ``step`` for `_complete`."""
        sampling_rows = set(schedule.advance())
        launched: dict[str, RequestGroup] = {}
        for row, (seq, start, num_tokens) in enumerate(rows):
            self.block_manager.cache_blocks(seq)  # later steps that hit them run after this one on the device
            group = self.requests[seq.request_id]
            if step.launched.wants_prompt_logprobs(row):
                step.prompt_rows.append((group, row, start, num_tokens))
            if row not in sampling_rows:
                continue  # a prefill chunk that did not reach the end of the prompt samples nothing
            step.samples.append((group, seq, row, group.on_launch(seq)))
            launched[group.request_id] = group
        for group in launched.values():
            self._apply(group.take_update())  # forks of n > 1, sequences at their length limit

    def _resample(self, step: InFlightStep) -> None:
        """The step just dispatched only took its argmax: some of its constrained rows' grammars waited for the
        previous step's tokens, which were read since. Those rows' masks are filled now, and every row of the
        step is sampled from its logits (`StepRunner.resample`), once: the sampling costs what it would have."""
        masks = {}
        for group, seq, row, index in step.masks_pending:
            mask = group.grammar_mask(seq, index) if self.requests.get(group.request_id) is group else None
            if mask is not None:  # else stopped (or aborted) on the previous token: this row's token is dropped
                masks[row] = mask
        self.stats.num_late_masks += len(masks)
        self.step_runner.resample(step.launched, masks)
        self.stats.num_late_sampled_steps += 1

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
        result = self.step_runner.collect(step.launched)
        if step.trace is not None:
            self.step_trace.completed(step.trace)
        for group, row, start, num_tokens in step.prompt_rows:
            if self.requests.get(group.request_id) is group:
                group.add_prompt_logprobs(start, num_tokens, result.prompt_logprobs_of(row))
        touched: dict[str, RequestGroup] = {}
        for group, seq, row, index in step.samples:
            if self.requests.get(group.request_id) is not group:
                continue  # aborted: this row's token is dropped
            if result.verifies:
                taken = self._take_verified(result, group, seq, row, index)
            else:
                taken = int(group.on_sample(seq, index, result.samples(row)[0]))
            if taken:
                self.stats.num_generation_tokens += taken
                touched[group.request_id] = group
        for group in touched.values():
            group.after_step()
            self._apply(group.take_update())
        return self._report(touched.values())

    def _take_verified(self, result: StepResult, group: RequestGroup, seq: Sequence, row: int, index: int) -> int:
        """A verifying step's row: its accepted drafts and its last token go to its group, in order, until one
        stops the sequence; the accepted drafts' K/V count as computed. Returns the tokens taken."""
        samples = result.samples(row)
        num_drafts, num_accepted = len(seq.spec_token_ids), len(samples) - 1
        seq.spec_token_ids = []
        seq.num_computed_tokens += num_accepted
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
            self.step_runner.fork(parent, child)
        for seq in update.finished:
            self.scheduler.finish(seq)
            self._release(seq, finished=True)

    def _release(self, seq: Sequence, *, finished: bool = False) -> None:
        """A sequence that finished, was aborted or preempted gives back its sampler slot and its proposer state
        (a finished one's output may stay with the proposer: suffix decoding's responses)."""
        self.step_runner.release(seq)
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


def _read_tokens(token_ids: list[int]) -> list[int]:
    """``token_ids`` without the placeholders at its end: a sequence that reaches its length limit finishes when
    its last step is dispatched, before that step's token is read."""
    end = len(token_ids)
    while end and token_ids[end - 1] == PLACEHOLDER_TOKEN:
        end -= 1
    return token_ids[:end]
