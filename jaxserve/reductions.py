"""Counts and index searches over a long axis (a vocabulary, a batch's rows) in the form XLA compiles cheaply.

The sampler and the logprobs reduce booleans and indices over a vocabulary, the ragged step's token layout over
the batch's rows. XLA:CPU splits an integer reduction over more than 32 entries into a tree of reduce-windows
(stride 32: three kernels for 49152 entries, each compiled apart), while these float32 sums stay one kernel:
a rank over [128, 49152] logits compiles in 126 ms as an int32 sum and in 70 ms as a float32 one, a first-index
search in 133 and 70 ms (2-core AMD EPYC, `docs/benchmarks/startup.md`). So these count and search in float32,
exactly: every count and index here is below 2**24, where float32 holds integers exactly (the largest
vocabularies are about 2**18).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

EXACT_LIMIT = 1 << 24  # float32 holds every integer up to here


def count_true(mask: jax.Array, axis: int = -1) -> jax.Array:
    """i32: how many entries of ``mask`` along ``axis`` are true."""
    _check_exact(mask.shape[axis])
    return jnp.sum(mask.astype(jnp.float32), axis=axis).astype(jnp.int32)


def first_true(mask: jax.Array) -> jax.Array:
    """i32[...]: the first index along the last axis where ``mask`` is true; the axis' length where it is nowhere."""
    size = mask.shape[-1]
    _check_exact(size)
    index = jax.lax.broadcasted_iota(jnp.float32, mask.shape, mask.ndim - 1)
    return jnp.min(jnp.where(mask, index, float(size)), axis=-1).astype(jnp.int32)


def last_true(mask: jax.Array) -> jax.Array:
    """i32[...]: the last index along the last axis where ``mask`` is true; -1 where it is nowhere."""
    _check_exact(mask.shape[-1])
    index = jax.lax.broadcasted_iota(jnp.float32, mask.shape, mask.ndim - 1)
    return jnp.max(jnp.where(mask, index, -1.0), axis=-1).astype(jnp.int32)


def _check_exact(size: int) -> None:
    if size > EXACT_LIMIT:
        raise ValueError(f"a float32 count or index over {size} entries is not exact (at most {EXACT_LIMIT})")
