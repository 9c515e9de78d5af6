"""The only owner of device state: parameters, the KV pool and one compiled executable per bucket.

The engine hands it a bucket and padded numpy arrays; it dispatches the bucket's executable, which runs
the model over the paged KV pool (donated, so updated in place) and samples one token per sequence.
Dispatch is asynchronous: a step may take some of its input tokens from the previous step's sampled
tokens while they are still on the device (`feed_rows`/`feed_cols`), so the host can schedule and
prepare step N+1 before it has read step N's tokens.
Executables are compiled ahead of time from `ShapeDtypeStruct`s (`jit(...).lower(...).compile()`), so
serving never compiles; `num_compiles` counts every executable built. Everything lives on a device mesh
(`jaxserve.parallel`; one device unless tensor parallel): the structs carry the params' and pool's
shardings and the pool's out-sharding equals its in-sharding, so warm-up and serving agree and the
donated pool stays in place.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention import AttentionMetadata, get_attention_backend
from jaxserve.config import ModelConfig
from jaxserve.models import get_model_class
from jaxserve.parallel import (
    check_tensor_parallel,
    kv_pool_sharding,
    make_mesh,
    param_shardings,
    replicated,
    shard_params,
)
from jaxserve.sampler import SamplingTensors, sample


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The static shape of one executable: S sequences × Q query tokens, P pages of block table."""

    batch_size: int
    num_query_tokens: int
    pages_per_seq: int


def step_shape(bucket, block_size: int) -> StepShape:
    """Prefill buckets have `chunk_len` query tokens per sequence; decode buckets have one."""
    num_query_tokens = getattr(bucket, "chunk_len", 1)
    return StepShape(bucket.batch_size, num_query_tokens, -(-bucket.context_len // block_size))


@dataclasses.dataclass
class StepInputs:
    """Host-side, already padded to the bucket's shape."""

    input_ids: np.ndarray  # i32[S, Q]
    block_tables: np.ndarray  # i32[S, P]
    q_start: np.ndarray  # i32[S]
    lengths: np.ndarray  # i32[S]
    sample_index: np.ndarray  # i32[S], which query token's logits to sample from
    sampling: SamplingTensors
    feed_rows: np.ndarray | None = None  # i32[S], row of the previous step's tokens to feed in
    feed_cols: np.ndarray | None = None  # i32[S], column of input_ids that token replaces; -1: none


def feed_previous_tokens(input_ids, prev_tokens, feed_rows, feed_cols):
    """input_ids [S, Q] with column `feed_cols[s]` of row s replaced by `prev_tokens[feed_rows[s]]`."""
    fed = jnp.take(prev_tokens, feed_rows, mode="clip")[:, None]
    column = jnp.arange(input_ids.shape[1], dtype=jnp.int32)[None, :]
    return jnp.where(column == feed_cols[:, None], fed, input_ids)


BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_backend_compiles = 0


def _count_backend_compile(event: str, duration: float, **_) -> None:
    global _backend_compiles
    if event == BACKEND_COMPILE_EVENT:
        _backend_compiles += 1


jax.monitoring.register_event_duration_secs_listener(_count_backend_compile)


def num_backend_compiles() -> int:
    """Every XLA compilation in this process so far (ours or anyone's): "no compile after warm-up" checks."""
    return _backend_compiles


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
    ):
        """``abstract=True``: ``params`` are ``ShapeDtypeStruct``s and no KV pool is allocated; such a
        runner only compiles (precompilation into the persistent cache needs no device memory)."""
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.backend = get_attention_backend(attention_backend)
        self.mesh = mesh if mesh is not None else make_mesh(1)
        check_tensor_parallel(config, self.mesh.size)
        model_mesh = self.mesh if self.mesh.size > 1 else None  # one device: no per-head shard_map
        self.model = get_model_class(config.architecture)(config, self.dtype, self.backend, model_mesh)
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
        self.executables: dict[StepShape, jax.stages.Compiled] = {}
        self.num_compiles = 0
        self.compile_seconds = 0.0
        self._compile_lock = threading.Lock()  # warm-up compiles buckets from several threads

    def _abstract_pool(self) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        cfg = self.config
        shape = (cfg.num_layers, cfg.num_kv_heads, self.num_blocks, self.block_size, cfg.head_dim)
        pool = jax.ShapeDtypeStruct(shape, self.dtype, sharding=kv_pool_sharding(self.mesh))
        return pool, pool

    def _allocate_pool(self) -> tuple[jax.Array, jax.Array]:
        zeros = _zeros_program(self._abstract_pool()[0])
        return zeros(), zeros()

    def _no_tokens_struct(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.max_rows,), jnp.int32, sharding=replicated(self.mesh))

    def compile_allocations(self) -> None:
        """Compiles the programs that allocate the pool and `no_tokens` (so precompile caches them too)."""
        for struct in (self._abstract_pool()[0], self._no_tokens_struct()):
            _zeros_program(struct).lower().compile()

    def _step(self, params, kv_pool, input_ids, meta, sample_index, sampling, prev_tokens, feed_rows, feed_cols):
        input_ids = feed_previous_tokens(input_ids, prev_tokens, feed_rows, feed_cols)
        hidden, kv_pool = self.model.apply(params, input_ids, kv_pool, meta)
        last = jnp.take_along_axis(hidden, sample_index[:, None, None], axis=1)[:, 0]
        logits = self.model.apply(params, last, method=self.model.logits)
        tokens = jnp.zeros(self.max_rows, jnp.int32).at[: input_ids.shape[0]].set(sample(logits, sampling))
        return tokens, logits, kv_pool

    def _abstract_inputs(self, shape: StepShape):
        s, q, p = shape.batch_size, shape.num_query_tokens, shape.pages_per_seq
        rep = replicated(self.mesh)
        i32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.int32, sharding=rep)
        f32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.float32, sharding=rep)
        meta = AttentionMetadata(block_tables=i32(s, p), q_start=i32(s), lengths=i32(s))
        sampling = SamplingTensors(
            temperature=f32(s),
            top_k=i32(s),
            top_p=f32(s),
            min_p=f32(s),
            seeds=jax.ShapeDtypeStruct((s,), jnp.uint32, sharding=rep),
            steps=i32(s),
        )
        abstract = lambda tree: jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
        )
        return (
            abstract(self.params), abstract(self.kv_pool), i32(s, q), meta, i32(s), sampling,
            i32(self.max_rows), i32(s), i32(s),
        )

    def compile(self, shape: StepShape) -> jax.stages.Compiled:
        """Compiles (once) the executable for one step shape. Thread-safe for different shapes."""
        if shape not in self.executables:
            start = time.perf_counter()
            rep, pool = replicated(self.mesh), kv_pool_sharding(self.mesh)
            step = jax.jit(self._step, donate_argnums=(1,), out_shardings=(rep, rep, (pool, pool)))
            executable = step.lower(*self._abstract_inputs(shape)).compile()
            with self._compile_lock:
                self.executables[shape] = executable
                self.compile_seconds += time.perf_counter() - start
                self.num_compiles += 1
        return self.executables[shape]

    def execute(self, bucket, inputs: StepInputs, prev_tokens: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Dispatches one step without waiting for it.

        Returns (tokens i32[max_rows], logits f32[S, V]) as device arrays; rows past the bucket's batch
        are 0. `prev_tokens` is an earlier step's `tokens`, read where `inputs.feed_cols >= 0`.
        """
        shape = step_shape(bucket, self.block_size)
        executable = self.executables.get(shape)
        if executable is None:
            raise RuntimeError(f"no compiled executable for bucket {bucket} (shape {shape}); warm it up first")
        meta = AttentionMetadata(
            block_tables=inputs.block_tables, q_start=inputs.q_start, lengths=inputs.lengths
        )
        no_feed = np.full(shape.batch_size, -1, np.int32)
        feed_rows = no_feed if inputs.feed_rows is None else inputs.feed_rows
        feed_cols = no_feed if inputs.feed_cols is None else inputs.feed_cols
        tokens, logits, self.kv_pool = executable(
            self.params, self.kv_pool, inputs.input_ids, meta, inputs.sample_index, inputs.sampling,
            self.no_tokens if prev_tokens is None else prev_tokens, feed_rows, feed_cols,
        )
        return tokens, logits
