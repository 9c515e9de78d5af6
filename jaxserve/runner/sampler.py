"""Batched on-device sampling from per-row parameter arrays (inside the compiled step).

Every row carries its own parameters in two packed arrays (`SamplingTensors`: one f32 and one i32
column per parameter), so a new value never recompiles and a step copies two small arrays to the
device. The order is vLLM's:

  raw logits ── logprobs (raw_logprobs mode, `logprobs.py`)
      └─ tokens a row's grammar forbids masked (packed allowed-token bitmask, `engine/structured_outputs.py`)
       └─ + logit_bias, EOS/stop ids masked while fewer than min_tokens    (slot rows, `sampler_state.py`)
         └─ repetition / frequency / presence penalties                    (slot token counts)
            ├─ greedy rows: argmax
            └─ random rows: / temperature, min_p, top_k, then a top-p draw (`sample_random`)

Each stage sits behind a `lax.cond` on "does any row use it", so an all-greedy batch without
penalties or logprobs costs one argmax. A row's uniforms depend only on its seed and the number of tokens its
sequence has generated (counter-based, `uniforms`), so a seeded request samples the same tokens alone and in any
batch.

A random row draws with a handful of uniforms, not one Gumbel variate per vocabulary entry: inverse-CDF
draws from the min_p / top_k filtered weights (block sums, then one block's cumulative sum), the first
draw inside the top-p nucleus kept (rejection sampling, exact: a draw is in the nucleus with probability
at least top_p). Neither the vocabulary nor the nucleus is sorted; the exact nucleus (a bisection over the row's
values, `_NucleusDraw.nucleus_weights`) is found only in a step where some row's draws all missed it.
`filter_logits` finds the same cutoff from the logits for the speculative verifier's exact distributions.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.math_utils import cdiv
from jaxserve.reductions import count_true, first_true, last_true
from jaxserve.runner.logprobs import TokenLogprobs, token_logprobs
from jaxserve.runner.sampler_state import SlotState

_EPS = 1e-5
TOP_CANDIDATES = 256  # top-k / top-p look for their cutoff among this many largest logits first

FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
INT_COLUMNS = ("top_k", "seed", "step", "min_tokens", "slot", "prompt_len", "flags", "prompt_next_token")
FLAG_LOGIT_BIAS = 1
FLAG_LOGPROBS = 2
FLAG_PROMPT_LOGPROBS = 4
FLAG_GRAMMAR = 8  # the row's `allowed` bitmask applies (structured outputs)
PAD_FLOATS = (0.0, 1.0, 0.0, 0.0, 0.0, 1.0)  # a padding row is greedy and changes nothing


def bitmask_words(vocab_size: int) -> int:
    """int32 words of a packed per-row allowed-token bitmask."""
    return cdiv(vocab_size, 32)


@dataclasses.dataclass(frozen=True)
class SamplingRow:
    """Host values of one row; `floats` follow FLOAT_COLUMNS, the ints are INT_COLUMNS' named fields."""

    floats: tuple[float, ...]
    top_k: int = 0
    seed: int = 0
    step: int = 0  # tokens the sequence has generated so far
    min_tokens: int = 0
    slot: int | None = None
    prompt_len: int = 0
    flags: int = 0
    prompt_next_token: int = 0
    allowed: np.ndarray | None = None  # i32[ceil(V / 32)]: bit v % 32 of word v // 32 allows token v


@struct.dataclass
class SamplingTensors:
    floats: jax.Array  # f32[S, len(FLOAT_COLUMNS)]
    ints: jax.Array  # i32[S, len(INT_COLUMNS)]
    allowed: jax.Array  # i32[S, ceil(V / 32)]: a row's grammar's allowed tokens (read when FLAG_GRAMMAR)

    @classmethod
    def from_rows(cls, rows: list[SamplingRow], batch_size: int, no_slot: int, vocab_size: int) -> SamplingTensors:
        floats = np.empty((batch_size, len(FLOAT_COLUMNS)), np.float32)
        floats[:] = PAD_FLOATS
        ints = np.zeros((batch_size, len(INT_COLUMNS)), np.int32)
        ints[:, INT_COLUMNS.index("slot")] = no_slot
        if rows:
            floats[: len(rows)] = [r.floats for r in rows]
            ints[: len(rows)] = [
                (r.top_k, _as_int32(r.seed), r.step, r.min_tokens, no_slot if r.slot is None else r.slot,
                 r.prompt_len, r.flags, r.prompt_next_token)
                for r in rows
            ]
        allowed = every_token_allowed(batch_size, bitmask_words(vocab_size))
        masked = [(i, row.allowed) for i, row in enumerate(rows) if row.allowed is not None]
        if masked:  # a fresh array only for a step with constrained rows
            allowed = allowed.copy()
            for i, row_allowed in masked:
                allowed[i] = row_allowed
        return cls(floats, ints, allowed)

    def argmax_only(self) -> SamplingTensors:
        """The same rows taking their argmax, without filters, penalties, bias, grammar or logprobs: for a step
        whose sampling runs after it (`ModelRunner.resample`). What the step itself reads stays: each row's
        slot and prompt length (its token counts), prompt logprobs and their next tokens."""
        floats = np.empty_like(self.floats)
        floats[:] = PAD_FLOATS
        ints = self.ints.copy()
        ints[:, [INT_COLUMNS.index("top_k"), INT_COLUMNS.index("min_tokens")]] = 0
        ints[:, INT_COLUMNS.index("flags")] &= FLAG_PROMPT_LOGPROBS
        return SamplingTensors(floats, ints, every_token_allowed(*self.allowed.shape))

    def with_grammar_masks(self, masks: dict[int, np.ndarray]) -> SamplingTensors:
        """These (host) rows with each row of ``masks`` constrained by its grammar's allowed-token bitmask: for a
        step whose masks waited for the previous step's tokens (`ModelRunner.resample`)."""
        ints, allowed = self.ints.copy(), self.allowed.copy()
        for row, mask in masks.items():
            allowed[row] = mask
            ints[row, INT_COLUMNS.index("flags")] |= FLAG_GRAMMAR
        return SamplingTensors(self.floats, ints, allowed)

    @classmethod
    def abstract(cls, batch_size: int, vocab_size: int, sharding=None) -> SamplingTensors:
        sds = lambda columns, dtype: jax.ShapeDtypeStruct((batch_size, columns), dtype, sharding=sharding)
        return cls(sds(len(FLOAT_COLUMNS), jnp.float32), sds(len(INT_COLUMNS), jnp.int32),
                   sds(bitmask_words(vocab_size), jnp.int32))

    def _f(self, name: str) -> jax.Array:
        return self.floats[:, FLOAT_COLUMNS.index(name)]

    def _i(self, name: str) -> jax.Array:
        return self.ints[:, INT_COLUMNS.index(name)]

    temperature = property(lambda self: self._f("temperature"))
    top_p = property(lambda self: self._f("top_p"))
    min_p = property(lambda self: self._f("min_p"))
    presence_penalty = property(lambda self: self._f("presence_penalty"))
    frequency_penalty = property(lambda self: self._f("frequency_penalty"))
    repetition_penalty = property(lambda self: self._f("repetition_penalty"))
    top_k = property(lambda self: self._i("top_k"))
    step = property(lambda self: self._i("step"))
    min_tokens = property(lambda self: self._i("min_tokens"))
    slot = property(lambda self: self._i("slot"))
    prompt_len = property(lambda self: self._i("prompt_len"))
    prompt_next_token = property(lambda self: self._i("prompt_next_token"))
    flags = property(lambda self: self._i("flags"))

    @property
    def seed(self) -> jax.Array:
        return jax.lax.bitcast_convert_type(self._i("seed"), jnp.uint32)

    def flag(self, bit: int) -> jax.Array:
        return (self._i("flags") & bit) != 0


@struct.dataclass
class SamplerOutput:
    tokens: jax.Array  # i32[S]
    logprobs: TokenLogprobs  # of the raw logits; zeros unless some row asked


def sample(logits: jax.Array, params: SamplingTensors, slots: SlotState, num_logprobs: int) -> SamplerOutput:
    """logits f32[S, V] (raw) -> one token per row, plus raw logprobs when a row wants them."""
    tokens = sample_tokens(logits, params, slots)
    logprobs = jax.lax.cond(
        _any_logprobs(params),
        lambda: token_logprobs(logits, tokens, num_logprobs),
        lambda: TokenLogprobs.zeros(tokens.shape, num_logprobs),
    )
    return SamplerOutput(tokens, logprobs)


def sample_tokens(logits: jax.Array, params: SamplingTensors, slots: SlotState,
                  uncounted: jax.Array | None = None) -> jax.Array:
    """i32[S]: each row's token from its raw logits f32[S, V]. ``uncounted`` i32[S, D]: tokens the slot's counts
    hold that the row must not see (a verified draft's later drafts, `spec_verify.py`; vocab size: none).

    The random draw (`sample_random`, most of the sampler's compile time) is traced once: an all-greedy batch
    takes its argmax in branches that return tokens, never logits (a `lax.cond` that passes [S, V] logits
    through copies them, 15 ms per cond for a [64, 49152] batch on XLA:CPU, as much as the greedy sampler);
    a batch with random rows pays that copy once, beside its draw's cost."""
    processes = _any_processing(params)
    processed = lambda: process_logits(logits, params, slots, uncounted)

    def greedy_batch() -> jax.Array:
        return jax.lax.cond(processes, lambda: first_argmax(processed()), lambda: first_argmax(logits))

    def random_batch() -> jax.Array:
        return _tokens(jax.lax.cond(processes, processed, lambda: logits), params)

    return jax.lax.cond(jnp.all(greedy_rows(params)), greedy_batch, random_batch)


def process_logits(logits: jax.Array, params: SamplingTensors, slots: SlotState,
                   uncounted: jax.Array | None = None) -> jax.Array:
    """Raw logits with the grammar's mask, logit_bias, min_tokens and the penalties applied (before temperature)."""
    masked = apply_bias_and_min_tokens(apply_grammar(logits, params), params, slots)
    return apply_penalties(masked, params, slots, uncounted)


def _tokens(processed: jax.Array, params: SamplingTensors) -> jax.Array:
    """Greedy rows' argmax, random rows' draw."""
    return jnp.where(greedy_rows(params), first_argmax(processed), sample_random(processed, params))


def greedy_rows(params: SamplingTensors) -> jax.Array:
    """bool[S]: the rows that take their argmax (temperature 0)."""
    return params.temperature < _EPS


def takes_argmax_only(params: SamplingTensors) -> bool:
    """Whether every row of host ``params`` takes the argmax of its raw logits and nothing else: the predicates of
    `sample`'s conds, on the host (its result for such rows is `first_argmax(logits)` and zero logprobs)."""
    return bool(greedy_rows(params).all() & ~_any_processing(params) & ~_any_logprobs(params))


def _any_processing(params: SamplingTensors) -> jax.Array:
    """Whether some row's logits are processed before its token is chosen (grammar, logit_bias, min_tokens still in
    force, a penalty). Array methods only: the host asks it of NumPy rows too (`takes_argmax_only`)."""
    return (params.flag(FLAG_GRAMMAR).any() | params.flag(FLAG_LOGIT_BIAS).any()
            | (params.step < params.min_tokens).any() | _any_penalty(params))


def _any_logprobs(params: SamplingTensors) -> jax.Array:
    return params.flag(FLAG_LOGPROBS).any()


def first_argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, -1)`` (the first largest entry) as two vectorized reductions: XLA:CPU runs argmax's
    (value, index) reduction element by element, 2-3x slower over a [64, 49152] batch of logits."""
    largest = jnp.max(x, axis=-1, keepdims=True)
    # a NaN row (no entry equals its max) still names a token
    return jnp.minimum(first_true(x == largest), x.shape[-1] - 1)

def apply_grammar(logits: jax.Array, params: SamplingTensors) -> jax.Array:
    """Tokens outside a constrained row's packed bitmask get -inf; other rows are untouched."""
    constrained = params.flag(FLAG_GRAMMAR)

    def apply() -> jax.Array:
        vocab = jnp.arange(logits.shape[-1], dtype=jnp.int32)
        words = jnp.take(params.allowed, vocab // 32, axis=1).astype(jnp.uint32)  # [S, V]
        allowed = (words >> (vocab % 32).astype(jnp.uint32)) & 1
        return jnp.where(constrained[:, None] & (allowed == 0), -jnp.inf, logits)

    return jax.lax.cond(jnp.any(constrained), apply, lambda: logits)


def apply_bias_and_min_tokens(logits: jax.Array, params: SamplingTensors, slots: SlotState) -> jax.Array:
    use_bias = params.flag(FLAG_LOGIT_BIAS)
    before_min = params.step < params.min_tokens

    def apply() -> jax.Array:
        rows = slots.rows(params.slot)
        biased = logits + jnp.where(use_bias[:, None], rows.logit_bias, 0.0)
        return jnp.where(before_min[:, None] & rows.min_tokens_mask, -jnp.inf, biased)

    return jax.lax.cond(jnp.any(use_bias) | jnp.any(before_min), apply, lambda: logits)


def apply_penalties(logits: jax.Array, params: SamplingTensors, slots: SlotState,
                    uncounted: jax.Array | None = None) -> jax.Array:
    """vLLM's: repetition over prompt and output tokens, frequency and presence over output tokens (the slot's
    counts less ``uncounted``, see `sample_tokens`)."""
    rep = params.repetition_penalty[:, None]
    freq = params.frequency_penalty[:, None]
    presence = params.presence_penalty[:, None]

    def apply() -> jax.Array:
        rows = slots.rows(params.slot)
        counts = rows.output_counts
        if uncounted is not None:
            index = jnp.arange(counts.shape[0])[:, None]
            counts = counts.at[index, uncounted].add(-1, mode="drop")
        generated = counts > 0
        repeated = jnp.where(logits > 0, logits / rep, logits * rep)
        out = jnp.where(generated | rows.prompt_mask, repeated, logits)
        return out - freq * counts - presence * generated

    return jax.lax.cond(_any_penalty(params), apply, lambda: logits)


def _any_penalty(params: SamplingTensors) -> jax.Array:
    return ((params.repetition_penalty != 1.0).any() | (params.frequency_penalty != 0.0).any()
            | (params.presence_penalty != 0.0).any())


def sample_random(logits: jax.Array, params: SamplingTensors) -> jax.Array:
    """Temperature, min_p and top_k as weights, then one top-p draw per row from its own uniforms.

    A row's weights are exp(scaled - max) (its probabilities over the largest one), zero below min_p and
    outside top_k. Its draws come from those weights by inverse CDF; a draw x is in the top-p nucleus when the
    weight of the values above it is under top_p of the total (ties at the cutoff are all kept, as in
    `filter_logits`). The first draw in the nucleus is the token: exactly the renormalized nucleus
    distribution. Rows draw ``DRAWS_PER_PASS`` at a time, in a loop that ends once every row has its token (one pass
    in nearly every step); rows still outside after ``MAX_REDRAWS`` draws (top_p near 0) draw from the exact
    nucleus. Every uniform a row may use is drawn once, up front (one copy of the PRNG's hash in the program, not
    one per use), and the draw itself is traced once, in the loop's body (with a second copy for a first pass
    outside the loop, this function alone compiled in 1.51 CPU s against 1.30)."""
    draw = nucleus_draw(logits, params)
    tokens, found = draw.passes()

    def exact() -> jax.Array:
        return jnp.where(found, tokens, inverse_cdf_draw(draw.nucleus_weights(), draw.draws[:, MAX_REDRAWS:])[:, 0])

    return jax.lax.cond(jnp.all(found), lambda: tokens, exact)


def nucleus_draw(logits: jax.Array, params: SamplingTensors) -> _NucleusDraw:
    """The rows' scaled logits, their weights after min_p and top_k, and their uniforms (`sample_random`)."""
    scaled = logits / jnp.maximum(params.temperature, _EPS)[:, None]
    largest = jnp.max(scaled, axis=-1, keepdims=True)
    weights = jnp.exp(scaled - jnp.where(jnp.isfinite(largest), largest, 0.0))
    weights = jnp.where(weights < params.min_p[:, None], 0.0, weights)  # min_p: p < min_p * max p
    weights = jnp.where(scaled < _top_k_floor(scaled, params.top_k)[:, None], 0.0, weights)
    draws = uniforms(params, 0, MAX_REDRAWS + 1)  # draw numbers 0..MAX_REDRAWS
    return _NucleusDraw(scaled, weights, params.top_p, draws, jnp.sum(weights, axis=-1))


DRAWS_PER_PASS = 2  # draws per row checked against the nucleus in one pass of the loop (each a pass over the row)
MAX_REDRAWS = 32  # draw numbers a row may use before the exact cutoff (P(miss) <= (1 - top_p) ** 32)
DRAW_BLOCK = 256  # inverse CDF: cumulative block sums, then one block's cumulative sum


@dataclasses.dataclass(frozen=True)
class _NucleusDraw:
    scaled: jax.Array  # f32[S, V]
    weights: jax.Array  # f32[S, V], exp(scaled - max) after min_p and top_k
    top_p: jax.Array  # f32[S]
    draws: jax.Array  # f32[S, MAX_REDRAWS + 1], each row's uniforms of draw numbers 0..MAX_REDRAWS
    total: jax.Array  # f32[S], the sum of the weights (a field: a value cached inside the loop would leak its tracer)

    def passes(self) -> tuple[jax.Array, jax.Array]:
        """(token, in the nucleus) of each row: its first draw in the nucleus among draw numbers 0..MAX_REDRAWS-1,
        checked DRAWS_PER_PASS at a time until every row has one."""

        def one_pass(state):
            number, tokens, found = state
            numbers = jax.lax.dynamic_slice_in_dim(self.draws, number, DRAWS_PER_PASS, axis=1)
            candidates = inverse_cdf_draw(self.weights, numbers)  # [S, DRAWS_PER_PASS]
            inside = self._in_nucleus(candidates)
            first = jnp.take_along_axis(candidates, jnp.argmax(inside, axis=-1)[:, None], axis=-1)[:, 0]
            take = ~found & jnp.any(inside, axis=-1)
            return number + DRAWS_PER_PASS, jnp.where(take, first, tokens), found | take

        rows = self.top_p.shape[0]
        state = (jnp.int32(0), jnp.zeros(rows, jnp.int32), jnp.zeros(rows, bool))
        _, tokens, found = jax.lax.while_loop(lambda s: (s[0] < MAX_REDRAWS) & ~jnp.all(s[2]), one_pass, state)
        return tokens, found

    def nucleus_weights(self) -> jax.Array:
        """f32[S, V]: the weights inside each row's top-p nucleus, zero outside (the exact draw of a row whose draws
        all missed)."""
        return jnp.where(self.scaled >= self._cutoff()[:, None], self.weights, 0.0)

    def _cutoff(self) -> jax.Array:
        """f32[S]: each row's smallest value in the nucleus, where `_in_nucleus` starts to hold, by bisection over
        the values' ordered keys (a loop of 32 passes over the row: a small program, run only for rows whose draws
        all missed; `filter_logits` finds the same set from the logits, at several times the compile time)."""
        keys = _ordered_keys(self.scaled + 0.0)  # -0.0 -> +0.0: equal floats get equal keys
        limit = jnp.where(self.top_p >= 1.0, jnp.inf, self.top_p * self.total)
        above = lambda key: jnp.sum(jnp.where(keys > key[:, None], self.weights, 0.0), axis=-1)
        return _float_of_key(_smallest_key_where(keys, lambda key: above(key) < limit))

    def _in_nucleus(self, tokens: jax.Array) -> jax.Array:
        """bool[S, D]: whether each of a row's D tokens i32[S, D] is in its top-p nucleus."""
        value = jnp.take_along_axis(self.scaled, tokens, axis=-1)
        above = jnp.sum(jnp.where(self.scaled[:, None, :] > value[:, :, None], self.weights[:, None, :], 0.0), axis=-1)
        return (above < (self.top_p * self.total)[:, None]) | (self.top_p >= 1.0)[:, None]


def uniforms(params: SamplingTensors, first: int, count: int) -> jax.Array:
    """f32[S, count] in [0, 1): draw numbers first..first+count-1 of each row, counter-based: a 32-bit hash of the
    row's seed, its step (tokens the sequence has generated) and the draw number, so a row's draws depend on those
    alone. The hash is `lowbias32` (Wellons' hash-prospector: two multiply-xorshift rounds, full avalanche) chained
    over the three words; the seed enters xored with a constant (lowbias32(0) is 0). 23 bits of the last word make
    the uniform. A statistical test of the draws: tests/runner/test_sampler.py. Threefry-2x32 (jax.random's)
    compiled 6x slower here (177 against 31 ms on XLA:CPU for the sampler's [64, 33] draws), for a quality that
    choosing a token does not need."""
    shape = (params.seed.shape[0], count)
    seed = jnp.broadcast_to(params.seed[:, None], shape)
    step = jnp.broadcast_to(params.step.astype(jnp.uint32)[:, None], shape)
    numbers = jnp.broadcast_to(jnp.uint32(first) + jnp.arange(count, dtype=jnp.uint32), shape)
    bits = _lowbias32(_lowbias32(_lowbias32(seed ^ jnp.uint32(0x9E3779B9)) ^ step) ^ numbers)
    return jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0  # [1, 2) - 1


def _lowbias32(x: jax.Array) -> jax.Array:
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def inverse_cdf_draw(weights: jax.Array, uniforms: jax.Array) -> jax.Array:
    """i32[S, D]: for each uniform u of a row, the first index whose cumulative weight exceeds u * total.

    Two levels, so only block sums and D blocks are summed cumulatively: the block where the cumulative
    block sums pass the target, then the index inside it. An index with zero weight is never returned, whatever
    the order the sums were added in: each level takes the first entry of positive weight that passes
    (`_first_passing`)."""
    rows, vocab = weights.shape
    padded = cdiv(vocab, DRAW_BLOCK) * DRAW_BLOCK
    blocks = jnp.pad(weights, ((0, 0), (0, padded - vocab))).reshape(rows, padded // DRAW_BLOCK, DRAW_BLOCK)
    block_sums = jnp.sum(blocks, axis=-1)
    block_ends = _cumulative_sum(block_sums)
    target = uniforms * block_ends[:, -1:]  # [S, D]
    block = _first_passing(block_sums[:, None, :], block_ends[:, None, :], target)
    inside = jnp.take_along_axis(blocks, block[:, :, None], axis=1)  # [S, D, DRAW_BLOCK]
    before = jnp.take_along_axis(block_ends - block_sums, block, axis=1)
    index = _first_passing(inside, _cumulative_sum(inside), target - before)
    return block * DRAW_BLOCK + index


def _cumulative_sum(x: jax.Array) -> jax.Array:
    """``jnp.cumsum(x, -1)`` as a product with an upper-triangular matrix of ones. XLA:CPU splits a cumulative sum
    into two reduce-windows (a block's and the blocks') and the fusions around them, each kernel compiled apart; a
    dot is one kernel, at a few million multiply-adds per step. Its rounding may differ from the sequential sum's;
    `_first_passing` never picks a zero weight, whatever order the terms were added in."""
    n = x.shape[-1]
    ones_above = (jax.lax.broadcasted_iota(jnp.int32, (n, n), 0) <= jax.lax.broadcasted_iota(jnp.int32, (n, n), 1))
    # built in the program, not a NumPy constant: constants in the draw loop's body broke the engine's first step
    # (docs/benchmarks/startup.md; the cause was not isolated)
    ones_above = ones_above.astype(x.dtype)
    return jnp.matmul(x, ones_above, precision=jax.lax.Precision.HIGHEST)


def _first_passing(weights: jax.Array, cumulative: jax.Array, target: jax.Array) -> jax.Array:
    """i32[...]: along the last axis, the first entry of positive weight whose cumulative weight exceeds
    ``target``; where rounding leaves none (a target at the total), the last entry of positive weight."""
    positive = weights > 0
    passing = first_true(positive & (cumulative > target[..., None]))
    return jnp.minimum(passing, jnp.maximum(last_true(positive), 0))


def _top_k_floor(scaled: jax.Array, top_k: jax.Array, num_candidates: int = TOP_CANDIDATES) -> jax.Array:
    """f32[S]: each row's k-th largest value (top_k keeps the values at or above it); -inf where top_k is off.
    Read among the `num_candidates` largest values, by bisection for a row whose k is larger."""
    vocab = scaled.shape[-1]
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    c = min(num_candidates, vocab)

    def floors() -> jax.Array:
        top_values = jax.lax.top_k(scaled, c)[0]
        floor = jnp.take_along_axis(top_values, jnp.clip(k - 1, 0, c - 1)[:, None], axis=-1)[:, 0]
        floor = jnp.where(k >= vocab, -jnp.inf, floor)
        beyond = (k > c) & (k < vocab)
        bisected = lambda: _float_of_key(_top_k_key_cutoff(_ordered_keys(scaled + 0.0), k))
        return jax.lax.cond(jnp.any(beyond), lambda: jnp.where(beyond, bisected(), floor), lambda: floor)

    return jax.lax.cond(jnp.any(k < vocab), floors, lambda: jnp.full(k.shape, -jnp.inf, scaled.dtype))


def filter_logits(logits: jax.Array, params: SamplingTensors, num_candidates: int = TOP_CANDIDATES) -> jax.Array:
    """Scaled by temperature, tokens outside min_p, top_k and top_p at -inf (vocabulary order)."""
    scaled = logits / jnp.maximum(params.temperature, _EPS)[:, None]
    probs = jax.nn.softmax(scaled, axis=-1)
    below_min_p = probs < params.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    scaled = jnp.where(below_min_p, -jnp.inf, scaled)
    truncates = jnp.any(params.top_k > 0) | jnp.any(params.top_p < 1.0)
    return jax.lax.cond(
        truncates, lambda: _top_k_top_p(scaled, params.top_k, params.top_p, num_candidates), lambda: scaled
    )


def _top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, num_candidates: int) -> jax.Array:
    """Top-k and top-p both keep a prefix of the descending order: find each row's smallest kept value.

    The cutoff is first looked for among the `num_candidates` largest values (`lax.top_k`, a few ms). That
    is exact when every row's cutoff lies among them and its top-p normalizer is known: top_k at most
    num_candidates, or off (the normalizer is the whole vocabulary's). Otherwise it is found by bisection
    over the values (`_bisected_cutoff`), not by sorting the vocabulary: a sort of 8 x 49k takes about
    150 ms on 2 CPU cores, and compiling a sort of the vocabulary takes 8 of a TPU step's 17 s."""
    vocab = scaled.shape[-1]
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    top_values = jax.lax.top_k(scaled, min(num_candidates, vocab))[0]
    found, threshold = _prefix_cutoff(top_values, k, top_p, vocab, jax.nn.logsumexp(scaled, axis=-1))
    threshold = jax.lax.cond(jnp.all(found), lambda: threshold, lambda: _bisected_cutoff(scaled, k, top_p))
    return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)


def _bisected_cutoff(scaled: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Each row's smallest kept value under top-k (k = vocab: off) and then top-p, without sorting.

    A value x is kept when fewer than k values exceed it and the values exceeding it hold less than top_p of
    the top-k distribution: both hold from the row's maximum down to the cutoff, so the cutoff is the smallest
    value where they hold, found by bisection over the float's ordered bit pattern (32 halvings of a 32-bit
    range). Values tied at the cutoff are all kept (vLLM's top-p keeps those its sort happens to put first)."""
    scaled = scaled + 0.0  # -0.0 -> +0.0: equal floats get equal keys
    keys = _ordered_keys(scaled)
    top_k_cutoff = _top_k_key_cutoff(keys, k)
    in_top_k = keys >= top_k_cutoff[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, scaled, -jnp.inf), axis=-1)
    mass_above = lambda key: jnp.sum(jnp.where(keys > key[:, None], probs, 0.0), axis=-1)
    cutoff = _smallest_key_where(keys, lambda key: (key >= top_k_cutoff) & ((mass_above(key) < top_p) | (top_p >= 1.0)))
    return _float_of_key(cutoff)


def _top_k_key_cutoff(keys: jax.Array, k: jax.Array) -> jax.Array:
    """Per row, the smallest key with fewer than k keys above it: the k-th largest (i32[S])."""
    return _smallest_key_where(keys, lambda key: count_true(keys > key[:, None]) < k)


def _ordered_keys(x: jax.Array) -> jax.Array:
    """i32 keys with the order of the f32 values (negative floats' magnitude bits flipped)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _float_of_key(key: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), jnp.float32)


def _smallest_key_where(keys: jax.Array, holds) -> jax.Array:
    """Per row, the smallest key at which ``holds`` (monotone: false below some key, true from it on, true at the
    row's largest key) is true, by bisection: i32[S]."""
    low = jnp.min(keys, axis=-1) - 1  # holds nowhere below the row's values... or at its smallest: hi moves there
    high = jnp.max(keys, axis=-1)

    def halve(_, bounds):
        low, high = bounds
        mid = low + ((high - low).astype(jnp.uint32) >> 1).astype(jnp.int32)
        ok = holds(mid)
        return jnp.where(ok, low, mid), jnp.where(ok, mid, high)

    return jax.lax.fori_loop(0, 32, halve, (low, high))[1]


def _prefix_cutoff(
    descending: jax.Array,  # f32[S, C], the C largest values of each row, in descending order
    k: jax.Array,  # i32[S], top_k (vocab = off)
    top_p: jax.Array,  # f32[S]
    vocab: int,
    log_normalizer: jax.Array | None,  # f32[S], log-sum-exp of the whole row; None when C == vocab
) -> tuple[jax.Array, jax.Array]:
    """(whether each row's cutoff is exact from these values, the smallest value the row keeps)."""
    c = descending.shape[-1]
    in_top_k = jnp.arange(c)[None, :] < k[:, None]
    masked = jnp.where(in_top_k, descending, -jnp.inf)
    top_k_normalizer = jax.nn.logsumexp(masked, axis=-1)
    if log_normalizer is not None:  # top_k off: the whole row's; top_k <= C: the candidates'
        top_k_normalizer = jnp.where(k >= vocab, log_normalizer, top_k_normalizer)
    probs = jnp.exp(masked - top_k_normalizer[:, None])
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_top_k & ((cum_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    keep = keep.at[:, 0].set(True)  # the most likely token always survives
    num_keep = count_true(keep)
    threshold = jnp.take_along_axis(descending, (num_keep - 1)[:, None], axis=-1)[:, 0]
    unfiltered = (k >= vocab) & (top_p >= 1.0)
    threshold = jnp.where(unfiltered, -jnp.inf, threshold)
    found = unfiltered | (k <= c) | ((k >= vocab) & (num_keep < c))
    return found, threshold


@functools.lru_cache(maxsize=64)
def every_token_allowed(batch_size: int, num_words: int) -> np.ndarray:
    """The bitmask of a step without constrained rows: built once per shape, read-only (the runner keeps a copy of
    it on the device: `ModelRunner._device_sampling`)."""
    allowed = np.full((batch_size, num_words), -1, np.int32)
    allowed.flags.writeable = False
    return allowed


def _as_int32(seed: int) -> int:
    """A u32 seed stored in an i32 column (same bits)."""
    seed &= 0xFFFFFFFF
    return seed - (1 << 32) if seed >= 1 << 31 else seed
