"""The only owner of device state: parameters, the KV pool and one compiled executable per bucket.

The step runner (`step_runner.py`) hands it a bucket and the step's inputs, already padded to it
(`input_batch.py`: rows of equal length, or for a mixed step the rows' tokens back to back); it dispatches the
executable of the bucket's `StepShape`, which runs the model over the paged KV pool and counts the step's tokens in
the per-sequence sampler state (both donated, so updated in place), giving the logits where the step samples (a step of
several query tokens also leaves its final hidden states and targets in the donated `PromptPositions`, from which
the "prompt-logprobs" executable computes the prompt logprobs after a step where a row asks: `logprobs.py`); then
the sampler executable of the step's `SampleShape` (its batch size) samples one
token per sequence from those logits (`sampler.py`; a speculative step verifies its drafts, `spec_verify.py`),
with logprobs when a row asks. One sampler executable serves every step of its batch size, whatever the step's
tokens and context, so the sampler is compiled once per batch size, not into every step.
Dispatch is asynchronous: a step may take some of its input tokens from the previous step's sampled
tokens while they are still on the device (`feed_rows`/`feed_cols`), so the host can schedule and
prepare step N+1 before it has read step N's tokens.
A step with a constrained row (structured outputs) whose grammar waits for the previous step's token is
dispatched taking only each row's argmax; once the host has read that token and filled the masks, the same
sampler executable samples the step's rows again from its raw logits (`resample`: same keys, penalties and
logprobs), so the step was never held back (`StepRunner.resample`).
Two small executables serve forks (n > 1, beam search) and new sequences: `copy_blocks` (copy-on-write
of KV blocks and sampler slots) and `write_slot` (a slot's reset and its request's logit_bias /
min_tokens rows). Everything is compiled ahead of time from `ShapeDtypeStruct`s
(`jit(...).lower(...).compile()`), so serving never compiles; `num_compiles` counts every executable.
Everything lives on a device mesh (`distributed/sharding.py`; one device unless tensor parallel): the
structs carry the params', pool's and sampler state's shardings and the donated state's out-sharding
equals its in-sharding, so warm-up and serving agree and the donated buffers stay in place. The engine,
its KV sizing probe, precompile and target compiles all build their runner with `ModelRunner.for_engine`.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.attention.backends import get_attention_backend
from jaxserve.attention.kv_cache import (
    INT8_KV_DTYPE,
    ScaledPages,
    kind_pairs,
    kv_storage_dtype,
    kv_value_dtype,
    pool_of_kinds,
    pool_page_shape,
)
from jaxserve.attention.metadata import AttentionMetadata, row_offsets, token_layout
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.kv_cache_groups import first_block_ids
from jaxserve.config.model_config import ModelConfig
from jaxserve.core.buckets import BucketGrid
from jaxserve.distributed.sharding import (
    check_tensor_parallel,
    hidden_sharding,
    kv_pool_sharding,
    make_mesh,
    param_shardings,
    replicated,
    shard_params,
)
from jaxserve.logger import init_logger
from jaxserve.models import get_model_class
from jaxserve.models.common import unstack_layers, untie_lm_head
from jaxserve.precision import GPU_PLATFORMS
from jaxserve.runner.compiler_options import compiler_options
from jaxserve.runner.input_batch import SampleShape, StepInputs, StepShape, step_shape
from jaxserve.runner.logprobs import PromptPositions, TokenLogprobs, prompt_logprobs, prompt_targets
from jaxserve.runner.sampler import (
    FLAG_PROMPT_LOGPROBS,
    SamplingTensors,
    every_token_allowed,
    first_argmax,
    sample,
    takes_argmax_only,
)
from jaxserve.runner.sampler_state import SlotState, copy_slots, update_token_counts, write_slot
from jaxserve.runner.spec_verify import VerifyInputs, uncount_rejected
from jaxserve.runner.spec_verify import verify as verify_drafts

logger = init_logger("jaxserve.runner.model_runner")


class ExecutableSource(Protocol):
    """Where the runner gets its executables when there is a compile cache (`compilation.ExecutableStore`)."""

    loaded: set[str]  # names it gave out without compiling

    def load_or_compile(self, name: str, jitted, abstract_args: tuple,
                        compiler_options: dict | None = None) -> jax.stages.Compiled: ...


STEP_PREFIX = "step-"  # every step executable's name starts with it
PROMPT_LOGPROBS = "prompt-logprobs"  # the program of the prompt logprobs, run after a step where a row asks


def executable_name(shape: StepShape) -> str:
    """The step executable's name in an `ExecutableSource`."""
    kind = "t" if shape.ragged else "q"
    name = f"{STEP_PREFIX}s{shape.batch_size}-{kind}{shape.num_query_tokens}-p{shape.pages_per_seq}"
    if shape.num_sample_positions:
        name += f"-v{shape.num_sample_positions}x{shape.num_speculative_tokens}"
    return name


def sampler_name(shape: SampleShape) -> str:
    """The sampler executable's name in an `ExecutableSource`."""
    name = f"sample-s{shape.batch_size}"
    if shape.num_sample_positions:
        name += f"-v{shape.num_sample_positions}x{shape.num_speculative_tokens}"
    return name


def sample_shapes(step_shapes) -> list[SampleShape]:
    """The sample shapes of ``step_shapes``, each once: one sampler executable serves the steps of a shape."""
    return list(dict.fromkeys(shape.sample_shape for shape in step_shapes))


def feed_previous_tokens(input_ids, prev_tokens, feed_rows, feed_cols, row_starts):
    """input_ids with the slot at flat index `row_starts[s] + feed_cols[s]` replaced by `prev_tokens[feed_rows[s]]`
    (rows with `feed_cols[s] < 0` feed nothing)."""
    fed = jnp.take(prev_tokens, feed_rows, mode="clip")
    flat = input_ids.reshape(-1)
    index = jnp.where(feed_cols >= 0, row_starts + feed_cols, flat.shape[0])
    return flat.at[index].set(fed, mode="drop").reshape(input_ids.shape)


@struct.dataclass
class StepOutput:
    """Device arrays of one step; only `tokens` is always needed on the host."""

    tokens: jax.Array  # i32[max_rows], rows past the bucket's batch are 0 (fed to the next step)
    logits: jax.Array  # f32[S, V], the raw logits sampled from (read by `resample`, tests and debugging)
    logprobs: TokenLogprobs  # [S(, K)]: the sampled token's raw logprob and rank, and the top K
    prompt_logprobs: TokenLogprobs | None  # flat [N(, K)] over the step's input positions: each one's next token
    # a verifying step (`spec_verify.py`): each row's accepted drafts, i32[S]; its logits and logprobs are then
    # per sample position, [P(, ...)]
    num_accepted: jax.Array | None = None


@functools.cache
def _zeros_program(struct: jax.ShapeDtypeStruct):
    """A program that allocates a zeroed array with ``struct``'s shape, dtype and sharding on the device(s):
    one named program, so precompile can put it in the persistent cache."""

    def zeros() -> jax.Array:
        return jnp.zeros(struct.shape, struct.dtype)

    return jax.jit(zeros, out_shardings=struct.sharding)


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        params: dict,
        *,
        dtype: str,
        block_size: int,
        num_blocks: int,
        max_rows: int,
        attention_backend: str = "auto",
        mesh: jax.sharding.Mesh | None = None,
        abstract: bool = False,
        num_sampler_slots: int = 1,
        num_logprobs: int = 20,
        platform: str | None = None,
        kv_cache_dtype: str = "auto",
        max_step_tokens: int = 0,
        kind_blocks: tuple[int, ...] | None = None,
    ):
        """``kv_cache_dtype``: what the KV pool keeps, the model's dtype ("auto"), float8 ("fp8") or int8 with a
        scale per token and kv head ("int8"; see `attention/kv_cache.py`). ``max_step_tokens``: the query tokens of
        the largest step, the size of the prompt logprobs' `PromptPositions` (0: none, a draft model's runner).
        ``kind_blocks``: a pool of pages of several shapes, the blocks of each (`KVCacheLayout.blocks_of_kinds`;
        default: shared out for the model's longest context).
        ``abstract=True``: ``params`` are
        ``ShapeDtypeStruct``s and no KV pool (nor sampler state) is allocated; such a runner only compiles
        (precompilation into the persistent cache needs no device memory). ``platform``: what the steps are built
        for, by default the mesh's devices' platform (a deviceless TPU topology's devices say "tpu"; "cuda" builds
        for GPUs on a CPU mesh, lowering only)."""
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
        layout = config.kv_cache_layout
        self.kind_blocks = kind_blocks or layout.blocks_of_kinds(num_blocks, config.max_position_embeddings, block_size)
        # per group, the first block id of its kind: a step reads each group's table less it (`input_batch`)
        self.group_block_offsets = tuple(first_block_ids(self.kind_blocks)[kind] for kind in layout.group_kinds)
        self.mesh = mesh if mesh is not None else make_mesh(1)
        self.platform = platform = platform or self.mesh.devices.flat[0].platform
        self.backend = _attention_backend(config, attention_backend, platform)
        # XLA:GPU runs a lax.cond by copying its predicate to the host and waiting for it there, so the sampler's
        # conds held the host until the step's last kernel: no host work overlapped a step (docs/benchmarks/gpu.md).
        # There a step also returns its rows' argmax, and one whose rows all take it runs no sampler (`execute`)
        self.argmax_in_step = platform in GPU_PLATFORMS
        self._no_logprobs: dict[int, TokenLogprobs] = {}  # by batch size: an argmax-only step's logprobs, zeros
        if config.quantization is not None:  # "fp8" quantizes activations only on float8 matrix units
            capability = getattr(self.mesh.devices.flat[0], "compute_capability", None)
            self.config = config = dataclasses.replace(
                config, quantization=config.quantization.for_platform(platform, capability))
        check_tensor_parallel(config, self.mesh.size)
        model_mesh = self.mesh if self.mesh.size > 1 else None  # one device: no per-head shard_map
        self.num_kv_groups = config.kv_cache_layout.num_groups  # block tables per row (`config/kv_cache_groups.py`)
        self.kv_storage_dtype = kv_storage_dtype(kv_value_dtype(kv_cache_dtype, self.dtype), platform)
        # XLA:CPU keeps bf16 matmuls on its fast path only with one weight array per layer and with
        # untransposed weights (common.layer_stack, common.untie_lm_head); in float32 the scan is as fast and
        # compiles faster. XLA:GPU copies each layer's weights out of the stack in a scan (a slice feeding cuBLAS;
        # on an H200 a third of a Llama-3.2-1B decode step, docs/benchmarks/gpu.md): GPUs unroll. TPU keeps it
        cpu_bf16 = platform == "cpu" and self.dtype == jnp.bfloat16
        self.model = get_model_class(config.architecture)(
            config, self.dtype, self.backend, model_mesh, scan_layers=not (cpu_bf16 or platform in GPU_PLATFORMS),
            untie_lm_head=cpu_bf16 and config.tie_word_embeddings,
        )
        if not self.model.scan_layers:
            params = unstack_layers(params, config.num_layers)
        if self.model.untie_lm_head:
            params = untie_lm_head(params)
        if abstract:
            self.params = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
                param_shardings(params, self.mesh),
            )
        else:
            self.params = shard_params(params, self.mesh)
        self.kv_pool = self._abstract_pool() if abstract else self._allocate_pool()
        self.max_rows = max_rows  # every step returns its tokens padded to this many rows
        self.no_tokens = self._no_tokens_struct() if abstract else _zeros_program(self._no_tokens_struct())()
        self.num_sampler_slots = num_sampler_slots
        self.slot_state = self._abstract_slot_state()
        if not abstract:
            self.slot_state = jax.tree.map(lambda spec: _zeros_program(spec)(), self.slot_state)
        self.prompt_positions = None  # what the steps leave for the "prompt-logprobs" program (`logprobs.py`)
        if max_step_tokens:
            width = config.output_hidden_size
            positions = PromptPositions.abstract(max_step_tokens, width, self.dtype, hidden_sharding(self.mesh, width),
                                                 replicated(self.mesh))
            self.prompt_positions = positions if abstract else jax.tree.map(_device_zeros, positions)
        # the structs of the params, the pool, the sampler state and the prompt positions, taken once: a program
        # built in another thread (background compilation) never reads the arrays a running step is donating
        self._state_structs = _abstract((self.params, self.kv_pool, self.slot_state, self.prompt_positions))
        self.num_logprobs = max(num_logprobs, 1)  # K of the step's top-K logprobs (a static shape)
        self.max_copies = num_sampler_slots  # copy-on-write pairs per copy_blocks call
        self.executables: dict[StepShape, jax.stages.Compiled] = {}
        self.sampler_executables: dict[SampleShape, jax.stages.Compiled] = {}
        self._allowed_on_device: dict[tuple[int, int], jax.Array] = {}  # `_device_sampling`'s, by shape
        self.executable_store: ExecutableSource | None = None  # set by warm-up when there is a compile cache
        self.num_compiles = 0
        self.compile_seconds = 0.0
        self._compile_lock = threading.Lock()  # warm-up compiles buckets from several threads
        self._copy_executable = None
        self._write_slot_executable = None
        self._prompt_logprobs_executable = None

    @classmethod
    def for_engine(cls, model_config: ModelConfig, params: dict, config: EngineConfig, grid: BucketGrid,
                   mesh: jax.sharding.Mesh, *, abstract: bool = False, num_blocks: int | None = None,
                   platform: str | None = None) -> ModelRunner:
        """The runner of an engine with ``config`` on ``grid``. The engine, its KV sizing probe, precompile and
        target compiles all build it here, so they build the same executables: one sampler slot per sequence
        the grid may run, K = max_logprobs. ``num_blocks``: a pool of another size than the grid's (the probe).
        The model runs as configured for the grid's ``max_model_len`` (`ModelConfig.for_max_model_len`)."""
        return cls(
            model_config.for_max_model_len(grid.max_model_len), params, dtype=config.dtype, block_size=grid.block_size,
            num_blocks=grid.num_blocks if num_blocks is None else num_blocks, max_rows=grid.max_batch_size,
            attention_backend=config.attention_backend, mesh=mesh, abstract=abstract, platform=platform,
            num_sampler_slots=grid.max_num_seqs, num_logprobs=config.max_logprobs, kv_cache_dtype=config.kv_cache_dtype,
            max_step_tokens=max(bucket.num_tokens for bucket in grid.buckets),
            kind_blocks=grid.blocks_of_kinds(model_config.kv_cache_layout, num_blocks),
        )

    def _abstract_pool(self) -> tuple:
        """(K, V) pool structs: pages, or for an int8 pool `ScaledPages` of pages and their scales; for a model whose
        layers' pages differ in shape (Gemma 4), a tuple of such pairs, one per kind (`ModelConfig.kv_page_shapes`)."""
        cfg = self.config
        layout = cfg.kv_cache_layout
        pairs = tuple(self._abstract_kind_pool(layout.rows_of_kind(kind), num_kv_heads, head_dim, num_blocks)
                      for kind, ((num_kv_heads, head_dim), num_blocks)
                      in enumerate(zip(cfg.kv_page_shapes, self.kind_blocks, strict=True)))
        return pool_of_kinds(pairs)

    def _abstract_kind_pool(self, rows: int, num_kv_heads: int, head_dim: int, num_blocks: int) -> tuple:
        tokens_per_row = self.backend.tokens_per_row(self.block_size, head_dim)
        page = pool_page_shape(self.block_size, head_dim, tokens_per_row)
        blocks = (rows, num_kv_heads, num_blocks)
        struct = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=self._pool_sharding)
        pool = struct((*blocks, *page), self.kv_storage_dtype)
        if self.kv_storage_dtype == INT8_KV_DTYPE:
            if self.config.kv_values_in_keys:
                raise ValueError("kv_cache_dtype int8 keeps no latent (MLA) pool: use auto or fp8")
            pool = ScaledPages(pool, struct((*blocks, self.block_size), jnp.float32))
        if self.config.kv_values_in_keys:  # MLA: the values are the keys' latent, no V pages
            return pool, struct((*blocks, page[0], 0), self.kv_storage_dtype)
        return pool, pool

    @property
    def _pool_sharding(self):
        """The KV pool's sharding on the mesh (a pool of latents whole on every device: `kv_pool_sharding`)."""
        return kv_pool_sharding(self.mesh, self.config.kv_values_in_keys)

    def _allocate_pool(self) -> tuple:
        """Zeroed K and V pools: one allocation program per array shape (K's and V's are the same), run for each."""
        structs = self._abstract_pool()
        zeros = {spec: _zeros_program(spec) for spec in jax.tree.leaves(structs)}
        return jax.tree.map(lambda spec: zeros[spec](), structs)

    def _no_tokens_struct(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.max_rows,), jnp.int32, sharding=replicated(self.mesh))

    def _abstract_slot_state(self) -> SlotState:
        """The sampler state's structs, replicated on the mesh (every device samples the same rows)."""
        abstract = SlotState.abstract(self.num_sampler_slots, self.config.vocab_size)
        rep = replicated(self.mesh)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), abstract)

    def compile_allocations(self, *, forks: bool = True) -> dict[str, jax.stages.Compiled]:
        """Compiles the programs that allocate the pool, `no_tokens` and the sampler state, and (``forks``) the fork
        executables (so precompile caches them too: then an engine's start compiles nothing); returns them
        by name. A draft model's runner never forks: precompile builds its allocations only."""
        compiled = {name: jitted.lower().compile() for name, (jitted, _) in self._allocation_programs().items()}
        if not forks:
            return compiled
        self.compile_helpers()
        helpers = {"copy_blocks": self._copy_executable, "write_slot": self._write_slot_executable}
        if self._prompt_logprobs_executable is not None:
            helpers[PROMPT_LOGPROBS] = self._prompt_logprobs_executable
        return {**compiled, **helpers}

    def _allocation_programs(self) -> dict[str, tuple]:
        """The programs that allocate the pool, `no_tokens` and the sampler state, by name: (jitted, no args)."""
        structs = [*jax.tree.leaves(self._abstract_pool()), self._no_tokens_struct(),
                   *jax.tree.leaves(self._abstract_slot_state())]
        return {
            f"zeros-{'x'.join(map(str, spec.shape))}-{spec.dtype}": (_zeros_program(spec), ())
            for spec in dict.fromkeys(structs)
        }

    def programs(self, shapes, *, forks: bool = True) -> dict[str, tuple]:
        """Every program the engine runs, by name: (jitted function, abstract arguments) of the steps of
        ``shapes``, the allocations and (``forks``; a draft model's runner never forks) the forks (to lower them for
        a platform this host does not have)."""
        steps = {executable_name(shape): (self._step_jit(shape), self._abstract_inputs(shape)) for shape in shapes}
        samplers = {sampler_name(shape): self._sampler_program(shape) for shape in sample_shapes(shapes)}
        return {**steps, **samplers, **self._allocation_programs(), **(self._helper_programs() if forks else {})}

    def _step(self, params, kv_pool, slot_state, prompt_positions, input_ids, meta, sample_index, sampling,
              prev_tokens, feed_rows, feed_cols, verify=None):
        """The model over the step's tokens: the raw logits where it samples (f32[S, V], or at a verifying step's
        P sample positions f32[P, V]), the pool with the tokens' K/V, the slots with the tokens counted and (a step
        of several query tokens) ``prompt_positions`` with its hidden states and targets for the prompt logprobs.
        The sampler executable of the step's `SampleShape` samples from those logits."""
        row_starts = row_offsets(meta, input_ids.shape)
        input_ids = feed_previous_tokens(input_ids, prev_tokens, feed_rows, feed_cols, row_starts)
        hidden, kv_pool = self.model.apply(params, input_ids, kv_pool, meta)
        layout = token_layout(meta, input_ids.shape)
        slot_state = update_token_counts(slot_state, input_ids, layout, sampling.prompt_len, sampling.slot)
        sampled_at = row_starts + sample_index if verify is None else verify.flat_index
        hidden_at = hidden.reshape(-1, hidden.shape[-1])[sampled_at]
        logits = self.model.apply(params, hidden_at, method=self.model.logits)
        if prompt_positions is not None and input_ids.shape[1] > 1:
            targets = prompt_targets(input_ids, layout, meta.lengths, sampling.prompt_next_token)
            # the model's hidden states are whole on every device: each keeps its slice of H (a constraint, else
            # the partitioner would split the layers' activations on H to match the buffer)
            hidden = jax.lax.with_sharding_constraint(hidden, replicated(self.mesh))
            prompt_positions = prompt_positions.written(hidden, targets)
        if self.argmax_in_step and verify is None:  # what the sampler gives rows that take their argmax only
            return logits, kv_pool, slot_state, prompt_positions, self._padded(first_argmax(logits))
        return logits, kv_pool, slot_state, prompt_positions

    def _padded(self, tokens: jax.Array) -> jax.Array:
        """A step's S tokens padded with zeros to max_rows (the shape every step's tokens are fed from)."""
        return jnp.zeros(self.max_rows, jnp.int32).at[: tokens.shape[0]].set(tokens)

    def _prompt_logprobs(self, params, prompt_positions, num_tokens) -> TokenLogprobs:
        """The "prompt-logprobs" program: the logprobs of the first ``num_tokens`` positions a step left in
        ``prompt_positions`` (its flat input positions), arrays [N(, K)]."""
        logits_fn = lambda h: self.model.apply(params, h, method=self.model.logits)
        return prompt_logprobs(prompt_positions, num_tokens, logits_fn, self.num_logprobs)

    def _sample(self, slot_state, logits, sampling):
        """A step's tokens (i32[max_rows]) and logprobs sampled from its raw logits f32[S, V] under ``sampling``."""
        sampled = sample(logits, sampling, slot_state, self.num_logprobs)
        return self._padded(sampled.tokens), sampled.logprobs

    def _verify(self, slot_state, logits, sampling, verify):
        """A speculative engine's mixed step: its rows' drafts verified from its logits f32[P, V] at the sample
        positions (spec_verify.py); (tokens, logprobs, accepted drafts per row) and the slots without the
        rejected drafts' counts."""
        verified = verify_drafts(logits, sampling, slot_state, verify, self.num_logprobs)
        slot_state = uncount_rejected(slot_state, sampling, verify, verified.num_accepted)
        return (self._padded(verified.tokens), verified.logprobs, verified.num_accepted), slot_state

    def _sampler_program(self, shape: SampleShape) -> tuple:
        """(jitted, abstract arguments) of the sampler executable of steps of ``shape``."""
        rep = replicated(self.mesh)
        vocab = self.config.vocab_size
        num_logits = shape.num_sample_positions or shape.batch_size
        args = (self._state_structs[2], jax.ShapeDtypeStruct((num_logits, vocab), jnp.float32, sharding=rep),
                SamplingTensors.abstract(shape.batch_size, vocab, rep))
        if not shape.num_sample_positions:
            return jax.jit(self._sample, out_shardings=rep), args
        verify = VerifyInputs.abstract(shape.num_sample_positions, shape.batch_size, shape.num_speculative_tokens, rep)
        return jax.jit(self._verify, donate_argnums=(0,), out_shardings=(rep, rep)), (*args, verify)

    def _copy_blocks(self, kv_pool, slot_state, block_src, block_dst, slot_src, slot_dst):
        """Copy-on-write: KV block dst[i] := block src[i] in every layer (`copy_pool_blocks`), slot dst[i] :=
        slot src[i]."""
        return copy_pool_blocks(kv_pool, block_src, block_dst, self.kind_blocks), copy_slots(slot_state, slot_src,
                                                                                             slot_dst)

    def _abstract_inputs(self, shape: StepShape):
        s, p = shape.batch_size, shape.pages_per_seq
        rep = replicated(self.mesh)
        i32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.int32, sharding=rep)
        query_starts = i32(s) if shape.ragged else None
        tables = i32(s, p) if self.num_kv_groups == 1 else i32(self.num_kv_groups, s, p)
        meta = AttentionMetadata(block_tables=tables, q_start=i32(s), lengths=i32(s), query_starts=query_starts)
        verify = None
        if shape.num_sample_positions:
            verify = VerifyInputs.abstract(shape.num_sample_positions, s, shape.num_speculative_tokens, rep)
        return (
            *self._state_structs, i32(*shape.input_shape), meta, i32(s),
            SamplingTensors.abstract(s, self.config.vocab_size, rep), i32(self.max_rows), i32(s), i32(s), verify,
        )

    def compile(self, shape: StepShape) -> jax.stages.Compiled:
        """Compiles (once) the executable for one step shape. Thread-safe for different shapes."""
        if shape not in self.executables:
            executable = self._compile(self._step_jit(shape), self._abstract_inputs(shape), executable_name(shape))
            with self._compile_lock:
                self.executables[shape] = executable
        return self.executables[shape]

    def resident_bytes(self) -> int:
        """Bytes per device of the weights, the KV pool and the prompt logprobs' positions: on the device while a
        sampler executable runs, though not among its arguments."""
        shard_bytes = lambda x: int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
        return sum(shard_bytes(x) for x in jax.tree.leaves((self.params, self.kv_pool, self.prompt_positions)))

    def compile_sampler(self, shape: SampleShape) -> jax.stages.Compiled:
        """Compiles (once) the sampler executable of steps of ``shape``. Thread-safe for different shapes."""
        if shape not in self.sampler_executables:
            executable = self._compile(*self._sampler_program(shape), sampler_name(shape))
            with self._compile_lock:
                self.sampler_executables[shape] = executable
        return self.sampler_executables[shape]

    def _sampler(self, shape: SampleShape) -> jax.stages.Compiled:
        executable = self.sampler_executables.get(shape)
        if executable is None:
            raise RuntimeError(f"no compiled sampler executable for {shape}; warm it up first")
        return executable

    def _step_jit(self, shape: StepShape):
        rep, pool = replicated(self.mesh), self._pool_sharding
        positions = jax.tree.map(lambda x: x.sharding, self._state_structs[3])
        argmax = (rep,) if self.argmax_in_step and not shape.num_sample_positions else ()  # `_step`'s argmax tokens
        return jax.jit(self._step, donate_argnums=(1, 2, 3), out_shardings=(rep, pool, rep, positions, *argmax))

    def compiler_options_of(self, name: str) -> dict | None:
        """The XLA options the program ``name`` (a key of `programs`) compiles with: a step and the prompt logprobs
        (the model's lm head) compute in the engine's dtype, every other program in float32 (`compiler_options.py`)."""
        in_engine_dtype = name.startswith(STEP_PREFIX) or name == PROMPT_LOGPROBS
        return compiler_options(self.platform, self.dtype if in_engine_dtype else jnp.float32)

    def _compile(self, jitted, abstract_args, name: str) -> jax.stages.Compiled:
        """The executable of ``jitted`` on ``abstract_args``: through the executable store when there is one
        (stored executables are loaded, not traced), else lowered and compiled, with the options of the
        program ``name`` (`compiler_options_of`)."""
        start = time.perf_counter()
        options = self.compiler_options_of(name)
        if self.executable_store is not None:
            compiled = self.executable_store.load_or_compile(name, jitted, abstract_args, options)
        else:
            compiled = jitted.lower(*abstract_args).compile(options)
        with self._compile_lock:
            self.compile_seconds += time.perf_counter() - start
            self.num_compiles += 1
        return compiled

    def compile_helpers(self) -> None:
        """The fork executables, copy_blocks and write_slot, and the prompt logprobs' (once; warm-up builds them
        with the buckets)."""
        if self._copy_executable is not None:
            return
        programs = self._helper_programs()
        self._copy_executable = self._compile(*programs["copy_blocks"], "copy_blocks")
        self._write_slot_executable = self._compile(*programs["write_slot"], "write_slot")
        if self.prompt_positions is not None:
            self.compile_prompt_logprobs()

    def compile_prompt_logprobs(self) -> jax.stages.Compiled:
        """The prompt logprobs' executable (once; `compile_helpers` builds it with the forks')."""
        if self._prompt_logprobs_executable is None:
            program = self._helper_programs()[PROMPT_LOGPROBS]
            self._prompt_logprobs_executable = self._compile(*program, PROMPT_LOGPROBS)
        return self._prompt_logprobs_executable

    def _helper_programs(self) -> dict[str, tuple]:
        """The fork programs and (unless this runner computes none) the prompt logprobs' by name: (jitted
        function, abstract arguments)."""
        m, vocab = self.max_copies, self.config.vocab_size
        rep, pool = replicated(self.mesh), self._pool_sharding
        sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
        idx = sds((m,), jnp.int32)
        programs = {
            "copy_blocks": (
                jax.jit(self._copy_blocks, donate_argnums=(0, 1), out_shardings=(pool, rep)),
                (self._state_structs[1], self._state_structs[2], idx, idx, idx, idx),
            ),
            "write_slot": (
                jax.jit(write_slot, donate_argnums=(0,), out_shardings=rep),
                (self._state_structs[2], sds((), jnp.int32), sds((vocab,), jnp.float32),
                 sds((vocab,), jnp.bool_), sds((vocab,), jnp.int32), sds((vocab,), jnp.bool_)),
            ),
        }
        if self.prompt_positions is not None:
            programs[PROMPT_LOGPROBS] = (jax.jit(self._prompt_logprobs, out_shardings=rep),
                                         (self._state_structs[0], self._state_structs[3], sds((), jnp.int32)))
        return programs

    def execute(self, bucket, inputs: StepInputs, prev_tokens: jax.Array | None = None) -> StepOutput:
        """Dispatches one step and its sampler without waiting for them; returns its StepOutput as device arrays.

        `prev_tokens` is an earlier step's `tokens`, read where `inputs.feed_cols >= 0`."""
        shape = step_shape(bucket, self.block_size)
        executable = self.executables.get(shape)
        if executable is None:
            raise RuntimeError(f"no compiled executable for bucket {bucket} (shape {shape}); warm it up first")
        if shape.ragged != (inputs.query_starts is not None):
            raise ValueError(f"bucket {bucket} needs {'ragged' if shape.ragged else 'padded'} inputs")
        if bool(shape.num_sample_positions) != (inputs.verify is not None):
            verb = "needs" if shape.num_sample_positions else "takes no"
            raise ValueError(f"bucket {bucket} {verb} sample positions")
        meta = AttentionMetadata(inputs.block_tables, inputs.q_start, inputs.lengths, inputs.query_starts)
        no_feed = np.full(shape.batch_size, -1, np.int32)
        feed_rows = no_feed if inputs.feed_rows is None else inputs.feed_rows
        feed_cols = no_feed if inputs.feed_cols is None else inputs.feed_cols
        sampler = self._sampler(shape.sample_shape)
        sampling = self._device_sampling(inputs.sampling)
        logits, self.kv_pool, self.slot_state, self.prompt_positions, *argmax = executable(
            self.params, self.kv_pool, self.slot_state, self.prompt_positions, inputs.input_ids, meta,
            inputs.sample_index, sampling, self.no_tokens if prev_tokens is None else prev_tokens, feed_rows,
            feed_cols, inputs.verify,
        )
        prompt_logprobs = self._run_prompt_logprobs(shape, inputs.sampling)
        if argmax and takes_argmax_only(inputs.sampling):  # the sampler would give these tokens, no logprobs
            return StepOutput(argmax[0], logits, self._zero_logprobs(shape.batch_size), prompt_logprobs)
        if inputs.verify is None:
            tokens, logprobs = sampler(self.slot_state, logits, sampling)
            return StepOutput(tokens, logits, logprobs, prompt_logprobs)
        (tokens, logprobs, num_accepted), self.slot_state = sampler(self.slot_state, logits, sampling,
                                                                    inputs.verify)
        return StepOutput(tokens, logits, logprobs, prompt_logprobs, num_accepted)

    def _device_sampling(self, sampling: SamplingTensors) -> SamplingTensors:
        """Host ``sampling`` whose bitmask, where no row is constrained (`every_token_allowed`), is a copy kept on
        the device: [S, V / 32] int32, 4 MB at 256 rows of Llama 3's vocabulary, was copied to the device twice a
        step (for the step and for its sampler). Not across processes: a follower host replays the step from the
        arrays it is sent, not this cached one, and the processes' arguments must match."""
        allowed = sampling.allowed
        unconstrained = isinstance(allowed, np.ndarray) and allowed is every_token_allowed(*allowed.shape)
        if not unconstrained or jax.process_count() > 1:
            return sampling
        if allowed.shape not in self._allowed_on_device:
            self._allowed_on_device[allowed.shape] = jax.device_put(allowed, replicated(self.mesh))
        return sampling.replace(allowed=self._allowed_on_device[allowed.shape])

    def _zero_logprobs(self, batch_size: int) -> TokenLogprobs:
        """What the sampler returns as the logprobs of S rows that ask for none, kept on the device (copied there
        from NumPy zeros: an eager `jnp.zeros` would compile while serving)."""
        if batch_size not in self._no_logprobs:
            zeros = TokenLogprobs.zeros((batch_size,), self.num_logprobs, xp=np)
            self._no_logprobs[batch_size] = jax.device_put(zeros, replicated(self.mesh))
        return self._no_logprobs[batch_size]

    def _run_prompt_logprobs(self, shape: StepShape, sampling: SamplingTensors) -> TokenLogprobs | None:
        """After a step of several query tokens where a row asks for prompt logprobs: every position's, flat
        [N(, K)] (dispatched before the next step overwrites the positions it left)."""
        if shape.input_shape[1] == 1 or not np.any(sampling.flags & FLAG_PROMPT_LOGPROBS):
            return None
        if self.prompt_positions is None:
            raise ValueError("this runner computes no prompt logprobs (max_step_tokens=0)")
        return self.compile_prompt_logprobs()(self.params, self.prompt_positions, np.int32(shape.num_tokens))

    def resample(self, output: StepOutput, sampling: SamplingTensors) -> StepOutput:
        """A dispatched step's output with its rows sampled again under ``sampling`` (its S rows) from its
        logits; dispatched without waiting, after the step and before the next one."""
        sampler = self._sampler(SampleShape(len(sampling.ints)))
        tokens, logprobs = sampler(self.slot_state, output.logits, sampling)
        return output.replace(tokens=tokens, logprobs=logprobs)

    def copy_blocks(self, block_copies: list[tuple[int, int]], slot_copies: list[tuple[int, int]]) -> None:
        """Applies copy-on-write pairs (src, dst) of KV blocks and sampler slots before the next step."""
        self.compile_helpers()
        m = self.max_copies
        for i in range(0, max(len(block_copies), len(slot_copies)), m):
            blocks, slots = block_copies[i : i + m], slot_copies[i : i + m]
            block_src, block_dst = _padded_pairs(blocks, m, self.num_blocks)
            slot_src, slot_dst = _padded_pairs(slots, m, self.slot_state.num_slots)
            self.kv_pool, self.slot_state = self._copy_executable(
                self.kv_pool, self.slot_state, block_src, block_dst, slot_src, slot_dst
            )

    def write_slot(self, slot: int, logit_bias: np.ndarray, min_tokens_mask: np.ndarray,
                   output_counts: np.ndarray, prompt_mask: np.ndarray) -> None:
        """Sets a sampler slot's rows: logit_bias f32[V], min_tokens mask bool[V], and the counts of the tokens
        before the sequence's first step, output_counts i32[V] and prompt_mask bool[V]."""
        self.compile_helpers()
        self.slot_state = self._write_slot_executable(
            self.slot_state, np.int32(slot), logit_bias.astype(np.float32), min_tokens_mask.astype(bool),
            output_counts.astype(np.int32), prompt_mask.astype(bool),
        )


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _attention_backend(config: ModelConfig, name: str, platform: str):
    """The attention backend a step of ``config`` runs on: ``name`` ("auto": `get_attention_backend`'s choice), but a
    pool of latents (MLA) whose rows the Pallas latent kernel does not take (`mla_attention.check_latent_shape`) on
    the reference backend under "auto" (with a warning), refused under "pallas"."""
    backend = get_attention_backend(name, platform)
    if not config.kv_values_in_keys or backend.name != "pallas":
        return backend
    from kernels_pallas.mla_attention import check_latent_shape

    try:
        check_latent_shape(config.head_dim, config.mla.kv_lora_rank)
    except ValueError as err:
        if name != "auto":
            raise ValueError(f"attention_backend='pallas' has no kernel for this latent attention: {err}") from err
        logger.warning("the Pallas latent kernel does not take this model's latent rows (%s); the steps use the "
                       "reference attention (plain XLA)", err)
        return get_attention_backend("reference", platform)
    return backend


def copy_pool_blocks(kv_pool, block_src: jax.Array, block_dst: jax.Array, kind_blocks: tuple[int, ...]):
    """The pool with block dst[i] := block src[i] in every layer. Sources are read before anything is written;
    out-of-range dst entries (padding) are no-ops. An int8 pool's scales are copied with its pages. A pool of several
    kinds of page (``kind_blocks`` of each, `config/kv_cache_groups.py`) copies each pair in the kind its ids are."""
    copied = []
    for pair, first, count in zip(kind_pairs(kv_pool, len(kind_blocks)), first_block_ids(kind_blocks), kind_blocks,
                                  strict=True):
        mine = (block_dst >= first) & (block_dst < first + count)
        dst, src = jnp.where(mine, block_dst - first, count), jnp.where(mine, block_src - first, 0)
        copied.append(jax.tree.map(lambda pool, dst=dst, src=src: _copy_blocks_of(pool, src, dst), pair))
    return pool_of_kinds(copied)


def _copy_blocks_of(pool: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """``pool`` [L, Hkv, num_blocks, ...] with block dst[i] := block src[i] (dst past the pool: none), block by block:
    an XLA gather of the blocks axis first relayouts the whole pool on TPU (measured deviceless on v6e: 13.4 GB of
    temporaries for DeepSeek-V2-Lite's 16.5 GB latent pool, where dynamic slices take none)."""
    num_blocks = pool.shape[2]
    take = lambda i: jax.lax.dynamic_slice_in_dim(pool, src[i], 1, axis=2)
    sources = jax.lax.fori_loop(0, src.shape[0], lambda i, buf: jax.lax.dynamic_update_slice_in_dim(
        buf, take(i), i, axis=2), jnp.zeros((*pool.shape[:2], src.shape[0], *pool.shape[3:]), pool.dtype))

    def put(i, pool):
        at = jnp.minimum(dst[i], num_blocks - 1)
        block = jnp.where(dst[i] < num_blocks, jax.lax.dynamic_slice_in_dim(sources, i, 1, axis=2),
                          jax.lax.dynamic_slice_in_dim(pool, at, 1, axis=2))
        return jax.lax.dynamic_update_slice_in_dim(pool, block, at, axis=2)

    return jax.lax.fori_loop(0, dst.shape[0], put, pool)


def _padded_pairs(pairs: list[tuple[int, int]], size: int, out_of_range: int) -> tuple[np.ndarray, np.ndarray]:
    src = np.zeros(size, np.int32)
    dst = np.full(size, out_of_range, np.int32)
    if pairs:
        src[: len(pairs)], dst[: len(pairs)] = zip(*pairs, strict=True)
    return src, dst


def _device_zeros(struct: jax.ShapeDtypeStruct) -> jax.Array:
    """A zeroed array put on ``struct``'s sharding from the host (no program to compile)."""
    return jax.device_put(np.zeros(struct.shape, struct.dtype), struct.sharding)
