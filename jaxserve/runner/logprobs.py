"""Log probabilities on the device (the host turns them into vLLM's dicts: `engine/logprobs.py`).

As vLLM's default (`logprobs_mode="raw_logprobs"`), logprobs are the log_softmax of the model's raw
logits, before logit_bias, penalties, temperature and top-k/top-p/min-p. The sampler returns, per row, the
top K (K = max_logprobs, a static shape) and the sampled token's logprob and rank (1 = most likely);
a request asking for k <= K keeps the first k. Prompt logprobs need the logits of every prompt position: a step of
several query tokens leaves its final hidden states and each position's target token in `PromptPositions` (a
buffer on the device, the size of the grid's largest step, donated to every step), and one program of its own
(`ModelRunner`'s "prompt-logprobs", run only after a step where a row asks) computes them from there, over chunks
of positions so the [positions, vocab] logits never exist at once. Kept out of the steps, the prompt logprobs are
compiled once rather than into every prefill and mixed step (docs/benchmarks/startup.md).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from jaxserve.attention.metadata import TokenLayout
from jaxserve.math_utils import cdiv, round_up
from jaxserve.reductions import count_true

PROMPT_LOGPROBS_CHUNK = 32  # prompt positions whose logits exist at once


@struct.dataclass
class TokenLogprobs:
    """Per row: a chosen token's logprob and rank, and the top-K logprobs."""

    token_logprob: jax.Array  # f32[...]
    token_rank: jax.Array  # i32[...]
    top_ids: jax.Array  # i32[..., K]
    top_logprobs: jax.Array  # f32[..., K]

    @classmethod
    def zeros(cls, batch_shape: tuple[int, ...], k: int, xp=jnp) -> TokenLogprobs:
        """Zeros in array module ``xp`` (NumPy for host arrays that are then copied to a device)."""
        return cls(xp.zeros(batch_shape, xp.float32), xp.zeros(batch_shape, xp.int32),
                   xp.zeros((*batch_shape, k), xp.int32), xp.zeros((*batch_shape, k), xp.float32))


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int) -> TokenLogprobs:
    """logits f32[..., V], tokens i32[...] -> log_softmax top-k, and the tokens' logprobs and ranks."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, k)
    chosen = jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)
    rank = count_true(logprobs >= chosen)  # vLLM: tokens at least as likely
    return TokenLogprobs(chosen[..., 0], rank, top_ids.astype(jnp.int32), top_logprobs)


def prompt_targets(
    input_ids: jax.Array,  # i32[S, Q] (or [1, T], ragged)
    layout: TokenLayout,  # each input slot's row, position and validity (`attention.token_layout`)
    lengths: jax.Array,  # i32[S], each row's context after the step (its last real token's position + 1)
    next_token: jax.Array,  # i32[S], the token after the row's chunk
) -> jax.Array:
    """The token each input slot predicts, in the input's shape: the next input token of its row, or for the
    row's last token the token after the chunk."""
    flat = input_ids.reshape(-1)
    shifted = jnp.concatenate([flat[1:], jnp.zeros_like(flat[:1])]).reshape(input_ids.shape)
    return jnp.where(layout.positions + 1 < lengths[layout.rows], shifted, next_token[layout.rows])


@struct.dataclass
class PromptPositions:
    """A step's positions for prompt logprobs, flat [N] (N: the grid's largest step's tokens, a multiple of
    `PROMPT_LOGPROBS_CHUNK`): the final hidden states and the token each position predicts; a step of T query
    tokens writes the first T."""

    hidden: jax.Array  # [N, H], the model's dtype
    targets: jax.Array  # i32[N]

    @classmethod
    def abstract(cls, max_step_tokens: int, hidden_size: int, dtype, hidden_sharding=None,
                 targets_sharding=None) -> PromptPositions:
        n = round_up(max_step_tokens, PROMPT_LOGPROBS_CHUNK)
        return cls(jax.ShapeDtypeStruct((n, hidden_size), dtype, sharding=hidden_sharding),
                   jax.ShapeDtypeStruct((n,), jnp.int32, sharding=targets_sharding))

    def written(self, hidden: jax.Array, targets: jax.Array) -> PromptPositions:
        """The buffer with a step's hidden states [..., H] and targets [...] (input-shaped) in its first rows."""
        flat_hidden = hidden.reshape(-1, hidden.shape[-1]).astype(self.hidden.dtype)
        return PromptPositions(self.hidden.at[: flat_hidden.shape[0]].set(flat_hidden),
                               self.targets.at[: targets.size].set(targets.reshape(-1)))


def prompt_logprobs(
    positions: PromptPositions,
    num_tokens: jax.Array,  # i32[], the positions a step wrote
    logits_fn: Callable[[jax.Array], jax.Array],  # [C, H] -> f32[C, V]
    k: int,
) -> TokenLogprobs:
    """Logprobs of the first ``num_tokens`` positions' targets and their top-k, arrays [N(, K)] (rows past
    ``num_tokens``, up to the end of their chunk, are zeros or a padding's values): one chunk of positions at a time."""
    n = positions.targets.shape[0]
    chunk = PROMPT_LOGPROBS_CHUNK

    def one_chunk(i, out: TokenLogprobs) -> TokenLogprobs:
        start = i * chunk
        hidden = jax.lax.dynamic_slice_in_dim(positions.hidden, start, chunk)
        targets = jax.lax.dynamic_slice_in_dim(positions.targets, start, chunk)
        found = token_logprobs(logits_fn(hidden), targets, k)
        return jax.tree.map(lambda o, f: jax.lax.dynamic_update_slice_in_dim(o, f, start, 0), out, found)

    return jax.lax.fori_loop(0, cdiv(num_tokens, chunk), one_chunk, TokenLogprobs.zeros((n,), k))
