"""LLMEngine: add_request / step / abort, the loop that LLM.generate and AsyncLLMEngine both drive.

Each `step()` asks the Scheduler for a Schedule, pads it to the chosen bucket and dispatches the
ModelRunner's precompiled executable. With `async_scheduling` (the default) it does not wait for that
step: every sampling row gets a placeholder token at once, so the scheduler can plan the next step, and
the next step reads the real tokens on the device. While the device runs step N, the host reads step
N-1's tokens, detokenizes, applies stop conditions and returns a RequestOutput for every request that
advanced. A sequence that stops on a token the host had not yet seen was already scheduled once more:
that extra row's token is dropped. Sequences that reach their length limit stop being scheduled as soon
as their last token is dispatched.
"""

from __future__ import annotations

import dataclasses
import random
import time

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.block_manager import BlockManager, kv_bytes_per_block, num_blocks_from_budget
from jaxserve.buckets import BucketGrid, load_bucket_spec
from jaxserve.compile_cache import (
    CacheManifest,
    CompileCounts,
    check_manifest,
    enable_persistent_cache,
    record_manifest,
    thread_compile_counts,
)
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.distributed import distributed_init_requested, initialize_distributed
from jaxserve.logger import init_logger
from jaxserve.model_runner import ModelRunner, StepInputs, step_shape
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.parallel import engine_mesh, per_device_bytes
from jaxserve.sampler import SamplingTensors
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.scheduler import Schedule, Scheduler
from jaxserve.sequence import Sequence, SequenceStatus
from jaxserve.warm_up import DEFAULT_COMPILE_THREADS, WarmUpReport, compile_buckets
from jaxserve.weights import LoadedModel, load_model

logger = init_logger("jaxserve.engine")

DEFAULT_CPU_KV_BLOCKS = 2048
PLACEHOLDER_TOKEN = -1  # a sampled token still on the device
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


@dataclasses.dataclass
class Request:
    """Host state of one request: its sequence, detokenizer and what was last reported."""

    request_id: str
    prompt: str | None
    params: SamplingParams
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    seed: int
    stop_reason: int | str | None = None
    num_accepted_tokens: int = 0  # output tokens the host has read back (the rest are placeholders)
    num_reported_tokens: int = 0
    num_reported_chars: int = 0
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    first_token_time: float | None = None


@dataclasses.dataclass
class InFlightStep:
    """A dispatched step whose sampled tokens the host has not read yet."""

    tokens: jax.Array  # i32[max_rows], on the device
    samples: list[tuple[Request, int, int]]  # (request, row, index of its placeholder in output_token_ids)
    rows_by_seq: dict[int, int]  # seq_id -> row, for feeding the tokens into the next step


@dataclasses.dataclass
class EngineStats:
    """Counters the benchmarks and the metrics endpoint read."""

    num_steps: int = 0
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    num_real_tokens: int = 0
    num_padded_tokens: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_compiles_after_warm_up: int = 0  # executables built while serving: should stay 0

    @property
    def padding_waste(self) -> float:
        """Padded slots per real token over all steps."""
        return self.num_padded_tokens / max(self.num_real_tokens, 1)


def engine_bucket_grid(
    config: EngineConfig, model_config: ModelConfig, params, platform: str, mesh: Mesh
) -> BucketGrid:
    """The bucket grid (with block size and KV-pool size) an engine with ``config`` runs on.

    ``params`` (arrays or ``ShapeDtypeStruct``s) only count towards the memory budget off CPU. The
    precompile command calls this too, so that it compiles exactly the engine's executables.
    """
    spec = load_bucket_spec(config.buckets, platform)
    block_size = config.block_size or spec.block_size
    num_blocks = _num_kv_blocks(config, model_config, params, block_size, platform, mesh)
    max_model_len = config.max_model_len or min(model_config.max_position_embeddings, max(spec.context_lengths))
    grid = BucketGrid(
        spec, block_size=block_size, max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs or max(spec.decode_batch_sizes),
        max_num_batched_tokens=config.max_num_batched_tokens
        or max(spec.prefill_batch_sizes) * max(spec.prefill_lengths),
        num_blocks=num_blocks,
    )
    grid.check_max_model_len(max_model_len)
    return grid


def _num_kv_blocks(
    config: EngineConfig, model_config: ModelConfig, params, block_size: int, platform: str, mesh: Mesh
) -> int:
    bytes_per_block = kv_bytes_per_block(
        num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads, block_size=block_size,
        head_dim=model_config.head_dim, dtype_bytes=jax.numpy.dtype(config.dtype).itemsize,
    )
    budget = None
    if platform != "cpu" and config.num_kv_blocks is None:  # per device: pool and weights are split
        stats = jax.local_devices()[0].memory_stats() or {}
        weights = per_device_bytes(params, mesh)
        limit = stats.get("bytes_limit", 0) * config.gpu_memory_utilization
        budget = int(limit - stats.get("bytes_in_use", 0) - weights)
    return num_blocks_from_budget(
        bytes_per_block // mesh.size, num_kv_blocks=config.num_kv_blocks,
        memory_budget_bytes=budget, default_cpu_blocks=DEFAULT_CPU_KV_BLOCKS,
    )


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, *, warm_up: bool = True):
        self.config = config
        if distributed_init_requested(config.distributed_init):
            initialize_distributed(config.coordinator_address, config.num_processes, config.process_id)
        if config.compile_cache_dir is not None:  # before anything compiles, so every executable is cached
            enable_persistent_cache(config.compile_cache_dir)
        self.mesh = engine_mesh(config.tensor_parallel_size)
        loaded = loaded or load_model(config.model, config.dtype, mesh=self.mesh)
        self.model_config = loaded.config
        self.model_path = loaded.path
        self.tokenizer = loaded.tokenizer
        self.grid = engine_bucket_grid(config, loaded.config, loaded.params, jax.default_backend(), self.mesh)
        self.block_size, num_blocks = self.grid.block_size, self.grid.num_blocks
        self.block_manager = BlockManager(num_blocks, self.block_size)
        self.max_model_len = self.grid.max_model_len
        self.scheduler = Scheduler(
            self.block_manager, self.grid,
            max_num_seqs=self.grid.max_num_seqs, max_num_batched_tokens=self.grid.max_num_batched_tokens,
            **({} if config.waiting_served_ratio is None else {"waiting_served_ratio": config.waiting_served_ratio}),
        )
        self.runner = ModelRunner(
            loaded.config, loaded.params, dtype=config.dtype, block_size=self.block_size,
            num_blocks=num_blocks, max_rows=self.grid.max_batch_size, attention_backend=config.attention_backend,
            mesh=self.mesh,
        )
        self._in_flight: InFlightStep | None = None
        self.async_scheduling = config.async_scheduling
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.warm_up_report: WarmUpReport | None = None
        self._rng = random.Random(config.seed)
        self.eos_token_ids = set(loaded.config.eos_token_id)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        if warm_up:
            self.warm_up()

    # ----- construction -------------------------------------------------------------------------
    def warm_up(self, num_threads: int = DEFAULT_COMPILE_THREADS) -> WarmUpReport:
        """Compiles (or loads from the compile cache) every feasible bucket; after this nothing compiles."""
        logger.info("%s", self.grid.format_table())
        cache_dir = check = manifest = None
        if self.config.compile_cache_dir is not None:
            cache_dir = enable_persistent_cache(self.config.compile_cache_dir)
            manifest = CacheManifest.current(
                self.model_config, self.config.dtype, self.grid, self.runner.backend.name, self.mesh.size,
                model=str(self.model_path), written_by="engine warm-up",
            )
            check = check_manifest(cache_dir, manifest)
            (logger.info if check.state in ("match", "empty") else logger.warning)("%s", check.describe())
        buckets = [*self.grid.prefill_buckets, *self.grid.decode_buckets]
        report = compile_buckets(self.runner, buckets, num_threads=num_threads, cache_dir=cache_dir, cache_check=check)
        if manifest is not None and not check.ok:
            record_manifest(cache_dir, manifest)  # every bucket of this configuration is in the cache now
        logger.info("warm-up: %s", report.summary())
        self.warm_up_report = report
        return report

    # ----- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: str | dict | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        raise TypeError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt must contain at least one token")
        max_tokens = params.max_tokens or self.max_model_len - len(token_ids)
        self.grid.check_request(len(token_ids), max_tokens)
        seq = Sequence(request_id, token_ids, params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        detok = IncrementalDetokenizer(self.tokenizer, token_ids, params)
        self.requests[request_id] = Request(request_id, text, params, seq, detok, seed & 0xFFFFFFFF)
        self.scheduler.add(seq)
        self.stats.num_prompt_tokens += len(token_ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.abort(request_id)
        request.seq.status = SequenceStatus.FINISHED_ABORTED
        return self._make_output(request, finished=True)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ----- one iteration ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and dispatches one step, then returns the outputs of the step before it (or of
        this one, without async scheduling)."""
        schedule = self.scheduler.schedule()
        self.stats.num_preemptions += len(schedule.preempted)
        outputs = [self._finish_ignored(seq) for seq in schedule.ignored]
        launched = None if schedule.is_idle else self._launch(schedule)
        if self._in_flight is not None:
            outputs += self._complete(self._in_flight)
        self._in_flight = launched
        if launched is not None and not self.async_scheduling:
            outputs += self._complete(launched)
            self._in_flight = None
        return outputs

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

    def _finish_ignored(self, seq: Sequence) -> RequestOutput:
        """A sequence the scheduler could never run (it reached max_model_len) ends with "length"."""
        request = self.requests.pop(seq.request_id)
        return self._make_output(request, finished=True)

    def _launch(self, schedule: Schedule) -> InFlightStep:
        """Dispatches the step and advances host state as if its tokens were known (placeholders)."""
        inputs = self._prepare_inputs(schedule)
        prev = self._in_flight.tokens if self._in_flight is not None else None
        compiles_before = thread_compile_counts()
        tokens, _ = self.runner.execute(schedule.bucket, inputs, prev)
        self._check_no_compile(compiles_before, schedule)
        samples, rows_by_seq = [], {}
        for row, (seq, _, num_tokens) in enumerate(self._rows(schedule)):
            seq.num_computed_tokens += num_tokens
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that did not reach the end of the prompt samples nothing
            request = self.requests[seq.request_id]
            seq.append_token(PLACEHOLDER_TOKEN)
            samples.append((request, row, seq.num_output_tokens - 1))
            rows_by_seq[seq.seq_id] = row
            if self._is_last_token(request, seq.num_output_tokens):
                self.scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)  # frees blocks; status settles later
        self._count_step(schedule)
        return InFlightStep(tokens, samples, rows_by_seq)

    def _is_last_token(self, request: Request, num_output_tokens: int) -> bool:
        max_tokens = request.params.max_tokens or self.max_model_len
        total = request.seq.num_prompt_tokens + num_output_tokens
        return num_output_tokens >= max_tokens or total >= self.max_model_len

    def _prepare_inputs(self, schedule: Schedule) -> StepInputs:
        shape = step_shape(schedule.bucket, self.block_size)
        rows = self._rows(schedule)
        s, q, p = shape.batch_size, shape.num_query_tokens, shape.pages_per_seq
        input_ids = np.zeros((s, q), np.int32)
        block_tables = np.zeros((s, p), np.int32)
        q_start = np.zeros(s, np.int32)
        lengths = np.zeros(s, np.int32)
        sample_index = np.zeros(s, np.int32)
        feed_rows = np.zeros(s, np.int32)
        feed_cols = np.full(s, -1, np.int32)
        sampling_rows = []
        for i, (seq, start, num_tokens) in enumerate(rows):
            input_ids[i, :num_tokens] = seq.all_token_ids[start : start + num_tokens]
            if input_ids[i, num_tokens - 1] == PLACEHOLDER_TOKEN:  # only ever a sequence's last token
                feed_rows[i], feed_cols[i] = self._in_flight.rows_by_seq[seq.seq_id], num_tokens - 1
            table = seq.block_table[:p]  # blocks past this step's context (reserved ahead) are not read
            block_tables[i, : len(table)] = table
            q_start[i], lengths[i], sample_index[i] = start, start + num_tokens, num_tokens - 1
            request = self.requests[seq.request_id]
            sampling_rows.append((request.params, request.seed, seq.num_output_tokens))
        sampling = SamplingTensors.from_rows(sampling_rows, s)
        return StepInputs(input_ids, block_tables, q_start, lengths, sample_index, sampling, feed_rows, feed_cols)

    @staticmethod
    def _rows(schedule: Schedule) -> list[tuple[Sequence, int, int]]:
        """(sequence, first position, number of tokens) for every real row of the step."""
        if schedule.is_prefill:
            return [(c.seq, c.start, c.num_tokens) for c in schedule.prefill_chunks]
        # longest first: rows of similar length share the attention's row groups (see attention.py)
        decode = sorted(schedule.decode_seqs, key=lambda seq: -seq.num_computed_tokens)
        return [(seq, seq.num_computed_tokens, 1) for seq in decode]

    def _count_step(self, schedule: Schedule) -> None:
        self.stats.num_steps += 1
        if schedule.is_prefill:
            self.stats.num_prefill_steps += 1
        else:
            self.stats.num_decode_steps += 1
        self.stats.num_real_tokens += schedule.num_batched_tokens
        self.stats.num_padded_tokens += schedule.num_padded_tokens

    def _complete(self, step: InFlightStep) -> list[RequestOutput]:
        """Reads a dispatched step's tokens (waits for the device) and applies them."""
        tokens = np.asarray(step.tokens)
        outputs = []
        for request, row, index in step.samples:
            if self.requests.get(request.request_id) is not request:
                continue  # aborted, or stopped on an earlier token: this row's token is dropped
            finished = self._accept_token(request, index, int(tokens[row]))
            if finished:
                self._retire(request)
            output = self._make_output(request, finished)
            if output is not None:
                outputs.append(output)
        return outputs

    def _retire(self, request: Request) -> None:
        """A finished request leaves: tokens dispatched after its last one are dropped, blocks freed."""
        seq = request.seq
        del seq.output_token_ids[request.num_accepted_tokens :]
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
        self.scheduler.finish(seq, seq.status)
        del self.requests[request.request_id]

    def _accept_token(self, request: Request, index: int, token_id: int) -> bool:
        """Token `index` of the output is now known: detokenize it, check the stop conditions and say
        whether the request is finished."""
        seq, params = request.seq, request.params
        seq.output_token_ids[index] = token_id
        request.num_accepted_tokens = num_generated = index + 1
        self.stats.num_generation_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        stop_string = request.detokenizer.append(token_id)
        can_stop = num_generated >= params.min_tokens
        if can_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            self._finish(request, SequenceStatus.FINISHED_STOPPED, None)
        elif can_stop and token_id in params.stop_token_ids:
            self._finish(request, SequenceStatus.FINISHED_STOPPED, token_id)
        elif stop_string is not None:
            self._finish(request, SequenceStatus.FINISHED_STOPPED, stop_string)
        elif self._is_last_token(request, num_generated):
            self._finish(request, SequenceStatus.FINISHED_LENGTH, None)
        else:
            return False
        return True

    @staticmethod
    def _finish(request: Request, status: SequenceStatus, stop_reason) -> None:
        request.seq.status = status
        request.stop_reason = stop_reason

    def _make_output(self, request: Request, finished: bool) -> RequestOutput | None:
        seq, kind = request.seq, request.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        text, token_ids = request.detokenizer.text, seq.output_token_ids[: request.num_accepted_tokens]
        if kind == RequestOutputKind.DELTA:
            text, token_ids = text[request.num_reported_chars :], token_ids[request.num_reported_tokens :]
        request.num_reported_chars = len(request.detokenizer.text)
        request.num_reported_tokens = request.num_accepted_tokens
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(token_ids),
            finish_reason=_FINISH_REASONS.get(seq.status) if finished else None,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(request.request_id, request.prompt, seq.prompt_token_ids, [completion], finished)
