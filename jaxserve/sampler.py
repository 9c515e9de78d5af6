"""Batched on-device sampling from per-request parameter arrays (inside the compiled step).

Each row of the batch carries its own temperature, top-k, top-p, min-p and PRNG key, so a new value
never recompiles. The key of a request is derived from its seed and the number of tokens it has
generated, so a seeded request samples the same tokens alone and inside any batch. A `lax.cond` fast
path skips sorting the vocabulary when the whole batch is greedy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

_EPS = 1e-5


@struct.dataclass
class SamplingTensors:
    temperature: jax.Array  # f32[S]; 0 = greedy
    top_k: jax.Array  # i32[S]; 0 = off
    top_p: jax.Array  # f32[S]; 1 = off
    min_p: jax.Array  # f32[S]; 0 = off
    seeds: jax.Array  # u32[S]
    steps: jax.Array  # i32[S], tokens generated so far (folded into the key)

    @classmethod
    def from_rows(cls, rows: list, batch_size: int) -> SamplingTensors:
        """rows: (SamplingParams, seed, num_generated) per real sequence; padding rows are greedy."""
        pad = batch_size - len(rows)
        temps = [p.temperature if not p.is_greedy else 0.0 for p, _, _ in rows] + [0.0] * pad
        return cls(
            temperature=np.asarray(temps, np.float32),
            top_k=np.asarray([p.effective_top_k for p, _, _ in rows] + [0] * pad, np.int32),
            top_p=np.asarray([p.top_p for p, _, _ in rows] + [1.0] * pad, np.float32),
            min_p=np.asarray([p.min_p for p, _, _ in rows] + [0.0] * pad, np.float32),
            seeds=np.asarray([s for _, s, _ in rows] + [0] * pad, np.uint32),
            steps=np.asarray([n for _, _, n in rows] + [0] * pad, np.int32),
        )


def sample(logits: jax.Array, params: SamplingTensors) -> jax.Array:
    """logits f32[S, V] → token ids i32[S]."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    all_greedy = jnp.all(params.temperature < _EPS)
    sampled = jax.lax.cond(all_greedy, lambda: greedy, lambda: _sample_random(logits, params))
    return jnp.where(params.temperature < _EPS, greedy, sampled)


def filtered_logits(logits: jax.Array, params: SamplingTensors) -> tuple[jax.Array, jax.Array]:
    """Temperature, top-k, top-p and min-p applied; returns (sorted masked logits, their token ids)."""
    temperature = jnp.maximum(params.temperature, _EPS)[:, None]
    scaled = logits / temperature
    sorted_logits, sorted_ids = jax.lax.top_k(scaled, scaled.shape[-1])
    ranks = jnp.arange(scaled.shape[-1])[None, :]
    keep = (params.top_k[:, None] <= 0) | (ranks < params.top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= cum_before < params.top_p[:, None]
    keep &= probs >= params.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)  # the most likely token always survives
    return jnp.where(keep, sorted_logits, -jnp.inf), sorted_ids


def _sample_random(logits: jax.Array, params: SamplingTensors) -> jax.Array:
    masked, sorted_ids = filtered_logits(logits, params)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(params.seeds, params.steps)
    choice = jax.vmap(jax.random.categorical)(keys, masked)
    return jnp.take_along_axis(sorted_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
