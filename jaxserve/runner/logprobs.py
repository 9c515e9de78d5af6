"""Log probabilities on the device, inside the step (the host turns them into vLLM's dicts: `engine/logprobs.py`).

As vLLM's default (`logprobs_mode="raw_logprobs"`), logprobs are the log_softmax of the model's raw
logits, before logit_bias, penalties, temperature and top-k/top-p/min-p. The step returns, per row, the
top K (K = max_logprobs, a static shape) and the sampled token's logprob and rank (1 = most likely);
a request asking for k <= K keeps the first k. Prompt logprobs need the logits of every prompt position:
they are computed only when a row asks for them (`lax.cond`), over chunks of positions so the
[rows, positions, vocab] logits never exist at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from jaxserve.attention.metadata import TokenLayout
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
    def zeros(cls, batch_shape: tuple[int, ...], k: int) -> TokenLogprobs:
        return cls(jnp.zeros(batch_shape, jnp.float32), jnp.zeros(batch_shape, jnp.int32),
                   jnp.zeros((*batch_shape, k), jnp.int32), jnp.zeros((*batch_shape, k), jnp.float32))


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


def prompt_logprobs(
    hidden: jax.Array,  # [S, Q, H], final hidden states
    targets: jax.Array,  # i32[S, Q]
    logits_fn: Callable[[jax.Array], jax.Array],  # [N, H] -> f32[N, V]
    k: int,
) -> TokenLogprobs:
    """Logprobs of every position's target token and the position's top-k: arrays [S, Q(, K)]."""
    s, q, h = hidden.shape
    chunk = math.gcd(q, PROMPT_LOGPROBS_CHUNK)
    hidden_chunks = hidden.reshape(s, q // chunk, chunk, h).swapaxes(0, 1)
    target_chunks = targets.reshape(s, q // chunk, chunk).swapaxes(0, 1)

    def one_chunk(args):
        hidden_c, targets_c = args  # [S, C, H], [S, C]
        logits = logits_fn(hidden_c.reshape(s * chunk, h))
        return token_logprobs(logits, targets_c.reshape(s * chunk), k)

    out = jax.lax.map(one_chunk, (hidden_chunks, target_chunks))  # leaves [Q/C, S*C(, K)]
    return jax.tree.map(lambda x: x.reshape(q // chunk, s, chunk, *x.shape[2:]).swapaxes(0, 1)
                        .reshape(s, q, *x.shape[2:]), out)
