"""Verifying draft tokens on the device, inside a speculative engine's mixed step (speculative decoding).

Place in the data flow: a proposer (`jaxserve/speculative/`) gives a decoding sequence up to K draft tokens; the
scheduler makes its row of the next mixed step ``[last token, d_0 .. d_{k-1}]``, so the step computes the K/V of
every draft and the logits after each. The step samples at ``P`` positions instead of one per row
(`VerifyInputs`, built by `runner/input_batch.py`): position ``j`` of a row sees the row's tokens up to ``d_{j-1}``
and tests ``d_j``; its last position (``j = k``) has no draft. Every position is a row of the ordinary sampler
(`sampler.sample_tokens`) with its row's parameters, its step advanced by ``j`` (keys, min_tokens) and the slot's
token counts less the drafts after it (penalties): what a step without speculation would sample there.

Acceptance (`verify`), per position with a draft:
  * greedy rows: the draft is accepted when it is the position's argmax;
  * random rows: rejection sampling against the proposer's distribution q. Every proposer here is a function of
    the sequence's tokens (n-gram lookup, a draft model's argmax), so q is a point mass on the draft: accept with
    probability p(d_j) (p: the position's distribution after every filter and penalty, `filter_logits`), else
    sample from p with d_j removed (the residual max(0, p - q), renormalized).
A row keeps its leading accepted drafts, then one more token: the residual sample at its first rejection, or at
its last position the ordinary sample (the bonus token). So the tokens are distributed exactly as without
speculation, and a row without drafts samples exactly what a plain step would (same key, same draws).

The step returns each row's last token (fed back as in a plain step), its number of accepted drafts, and raw
logprobs at every position of the tokens kept there; the host knows the drafts. `uncount_rejected` takes the
rejected drafts out of the sampler slot's counts (they were counted as the step's input tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.runner.logprobs import TokenLogprobs, token_logprobs
from jaxserve.runner.sampler import (
    FLAG_LOGPROBS,
    INT_COLUMNS,
    SamplingTensors,
    filter_logits,
    greedy_rows,
    inverse_cdf_draw,
    process_logits,
    sample_tokens,
    uniforms,
)
from jaxserve.runner.sampler_state import SlotState

VERIFY_DRAWS = 1 << 16  # draw numbers of a position's acceptance test and residual sample (past the sampler's)
NO_DRAFT = -1


@struct.dataclass
class VerifyInputs:
    """Where a step samples: P positions (static), in row order; padding positions belong to row S."""

    flat_index: jax.Array  # i32[P]: the step's flat query token whose logits the position samples
    row: jax.Array  # i32[P]: its row
    offset: jax.Array  # i32[P]: j, the row's drafts before it
    draft: jax.Array  # i32[P]: the draft it tests; NO_DRAFT at a row's last position
    row_positions: jax.Array  # i32[S, K + 1]: each row's positions in order, P past its last

    @classmethod
    def from_rows(cls, query_starts: list[int], num_tokens: list[int], drafts: list[list[int]], num_positions: int,
                  batch_size: int, num_speculative_tokens: int) -> VerifyInputs:
        """Host arrays for rows whose tokens start at ``query_starts`` in the flat input, ``num_tokens`` each, the
        last ``len(drafts[i]) + 1`` of them sampled (a prefill chunk: its last only)."""
        p, s = num_positions, batch_size
        needed = sum(len(d) + 1 for d in drafts)
        if needed > p:
            raise ValueError(f"{needed} sample positions do not fit the step's {p}")
        flat_index, offset = np.zeros(p, np.int32), np.zeros(p, np.int32)
        row, draft = np.full(p, s, np.int32), np.full(p, NO_DRAFT, np.int32)
        row_positions = np.full((s, num_speculative_tokens + 1), p, np.int32)
        position = 0
        for i, (start, n, row_drafts) in enumerate(zip(query_starts, num_tokens, drafts, strict=True)):
            k = len(row_drafts)
            span = slice(position, position + k + 1)
            flat_index[span] = start + n - 1 - k + np.arange(k + 1)
            row[span], offset[span] = i, np.arange(k + 1)
            draft[position : position + k] = row_drafts
            row_positions[i, : k + 1] = np.arange(position, position + k + 1)
            position += k + 1
        return cls(flat_index, row, offset, draft, row_positions)

    @classmethod
    def abstract(cls, num_positions: int, batch_size: int, num_speculative_tokens: int, sharding=None) -> VerifyInputs:
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
        p = num_positions
        return cls(i32(p), i32(p), i32(p), i32(p), i32(batch_size, num_speculative_tokens + 1))


@struct.dataclass
class VerifyOutput:
    tokens: jax.Array  # i32[S]: each row's last token (its first rejection's replacement or its bonus token)
    num_accepted: jax.Array  # i32[S]: its leading accepted drafts
    logprobs: TokenLogprobs  # [P]: raw logprobs of the token kept at each position (zeros unless a row asked)


def verify(logits: jax.Array, sampling: SamplingTensors, slots: SlotState, inputs: VerifyInputs,
           num_logprobs: int) -> VerifyOutput:
    """logits f32[P, V] (raw, at the sample positions) of a step whose rows sample under ``sampling`` (S rows)."""
    params = position_params(sampling, inputs)
    uncounted = later_drafts(inputs, logits.shape[-1])
    sampled = sample_tokens(logits, params, slots, uncounted)
    has_draft = inputs.draft != NO_DRAFT
    is_greedy = greedy_rows(params)
    tested = has_draft & ~is_greedy
    accept_random, residual = jax.lax.cond(
        jnp.any(tested),
        lambda: _rejection_test(logits, params, slots, uncounted, inputs.draft),
        lambda: (jnp.zeros_like(has_draft), sampled),
    )
    accepted = has_draft & jnp.where(is_greedy, sampled == inputs.draft, accept_random)
    kept = jnp.where(tested, residual, sampled)  # the token a position gives when its row stops there
    num_accepted, tokens = _row_results(inputs, accepted, kept)
    emitted = _emitted_tokens(inputs, num_accepted, kept)
    logprobs = jax.lax.cond(
        jnp.any(sampling.flag(FLAG_LOGPROBS)),
        lambda: token_logprobs(logits, emitted, num_logprobs),
        lambda: TokenLogprobs.zeros(emitted.shape, num_logprobs),
    )
    return VerifyOutput(tokens, num_accepted, logprobs)


def position_params(sampling: SamplingTensors, inputs: VerifyInputs) -> SamplingTensors:
    """Each position's sampling row: its row's, with ``step`` advanced by the drafts before it."""
    rows = jnp.clip(inputs.row, 0, sampling.ints.shape[0] - 1)
    ints = sampling.ints[rows]
    step = INT_COLUMNS.index("step")
    ints = ints.at[:, step].add(inputs.offset)
    return SamplingTensors(sampling.floats[rows], ints, sampling.allowed[rows])


def later_drafts(inputs: VerifyInputs, vocab_size: int) -> jax.Array:
    """i32[P, K]: the drafts of a position's row after it (counted in the slot by this step, unseen by it); the
    vocabulary size where none."""
    p = inputs.draft.shape[0]
    k = inputs.row_positions.shape[1] - 1
    positions = inputs.row_positions[:, :k]  # [S, K]: the positions testing each draft
    row_drafts = jnp.where(positions < p, inputs.draft[jnp.minimum(positions, p - 1)], NO_DRAFT)
    row_drafts = jnp.concatenate([row_drafts, jnp.full((1, k), NO_DRAFT, jnp.int32)])  # row S: padding
    mine = row_drafts[inputs.row]  # [P, K]
    later = jnp.arange(k, dtype=jnp.int32)[None, :] >= inputs.offset[:, None]
    return jnp.where(later & (mine != NO_DRAFT), mine, vocab_size)


def _rejection_test(logits, params, slots, uncounted, drafts) -> tuple[jax.Array, jax.Array]:
    """(accepted, residual sample) per position: u < p(d), and a draw from p without d."""
    filtered = filter_logits(process_logits(logits, params, slots, uncounted), params)
    probs = jax.nn.softmax(filtered, axis=-1)
    index = jnp.arange(probs.shape[0])
    safe_drafts = jnp.maximum(drafts, 0)
    draws = uniforms(params, VERIFY_DRAWS, 2)
    accepted = draws[:, 0] < probs[index, safe_drafts]
    residual = inverse_cdf_draw(probs.at[index, safe_drafts].set(0.0), draws[:, 1:])[:, 0]
    return accepted, residual


def _row_results(inputs: VerifyInputs, accepted: jax.Array, kept: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(leading accepted drafts, last token) of every row."""
    p = accepted.shape[0]
    valid = inputs.row_positions < p
    safe = jnp.minimum(inputs.row_positions, p - 1)
    row_accepted = valid & accepted[safe]  # [S, K + 1]; a row's last position never accepts
    num_accepted = jnp.sum(jnp.cumprod(row_accepted.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)
    last = jnp.take_along_axis(safe, num_accepted[:, None], axis=1)[:, 0]
    has_rows = valid[:, 0]
    return num_accepted, jnp.where(has_rows, kept[last], 0)


def _emitted_tokens(inputs: VerifyInputs, num_accepted: jax.Array, kept: jax.Array) -> jax.Array:
    """i32[P]: the token each position put in its sequence (an accepted draft, its row's last token), else 0."""
    padded = jnp.concatenate([num_accepted, jnp.zeros(1, jnp.int32)])
    row_accepted = padded[inputs.row]
    return jnp.where(inputs.offset < row_accepted, inputs.draft,
                     jnp.where(inputs.offset == row_accepted, kept, 0)).astype(jnp.int32)


def uncount_rejected(slots: SlotState, sampling: SamplingTensors, inputs: VerifyInputs,
                     num_accepted: jax.Array) -> SlotState:
    """The slot counts without the rejected drafts: the step counted every input token, and only the accepted
    drafts stay in their sequences."""
    padded = jnp.concatenate([num_accepted, jnp.zeros(1, jnp.int32)])
    slot_of_row = jnp.concatenate([sampling.slot, jnp.full(1, slots.num_slots, jnp.int32)])
    rejected = (inputs.draft != NO_DRAFT) & (inputs.offset >= padded[inputs.row])
    slot = jnp.where(rejected, slot_of_row[inputs.row], slots.num_slots)
    token = jnp.maximum(inputs.draft, 0)
    return slots.replace(output_counts=slots.output_counts.at[slot, token].add(-1, mode="drop"))
