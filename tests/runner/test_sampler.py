"""The on-device sampler against numpy references of each parameter's effect on the logits (vLLM's
definitions), the token-count state it reads, its logprobs, and seeded sampling's batch independence."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention.metadata import AttentionMetadata, token_layout
from jaxserve.runner.logprobs import (
    PROMPT_LOGPROBS_CHUNK,
    PromptPositions,
    prompt_logprobs,
    prompt_targets,
    token_logprobs,
)
from jaxserve.runner.sampler import (
    FLAG_GRAMMAR,
    FLAG_LOGIT_BIAS,
    FLAG_LOGPROBS,
    PAD_FLOATS,
    SamplingRow,
    SamplingTensors,
    _bisected_cutoff,
    _prefix_cutoff,
    apply_bias_and_min_tokens,
    apply_penalties,
    bitmask_words,
    filter_logits,
    first_argmax,
    inverse_cdf_draw,
    nucleus_draw,
    process_logits,
    sample,
    sample_random,
    takes_argmax_only,
    uniforms,
)
from jaxserve.runner.sampler_state import SlotState, SlotTable, copy_slots, update_token_counts, write_slot

V = 64
K = 8


def row(temperature=0.0, top_p=1.0, min_p=0.0, presence=0.0, frequency=0.0, repetition=1.0, **ints) -> SamplingRow:
    return SamplingRow((temperature, top_p, min_p, presence, frequency, repetition), **ints)


def tensors(rows: list[SamplingRow], batch_size: int | None = None, num_slots: int = 4) -> SamplingTensors:
    return SamplingTensors.from_rows(rows, batch_size or len(rows), num_slots, V)


def slot_state(rng, num_slots=4) -> SlotState:
    counts = rng.integers(0, 3, size=(num_slots, V)) * (rng.random((num_slots, V)) < 0.3)
    return SlotState(
        output_counts=jnp.asarray(counts, jnp.int32),
        prompt_mask=jnp.asarray(rng.random((num_slots, V)) < 0.2),
        logit_bias=jnp.asarray(rng.normal(0, 3, (num_slots, V)) * (rng.random((num_slots, V)) < 0.1), jnp.float32),
        min_tokens_mask=jnp.asarray(rng.random((num_slots, V)) < 0.05),
    )


def softmax(x):
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ----- numpy references (vLLM's definitions) ------------------------------------------------------------


def ref_penalties(logits, counts, prompt_mask, presence, frequency, repetition):
    generated = counts > 0
    out = np.where(generated | prompt_mask, np.where(logits > 0, logits / repetition, logits * repetition), logits)
    return out - frequency * counts - presence * generated


def ref_min_p(scaled, min_p):
    probs = softmax(scaled)
    return np.where(probs < min_p * probs.max(), -np.inf, scaled)


def ref_top_k(scaled, k):
    if k <= 0:
        return scaled
    kth = np.sort(scaled)[::-1][k - 1]
    return np.where(scaled < kth, -np.inf, scaled)


def ref_top_p(scaled, p):
    """vLLM: ascending sort, drop tokens whose cumulative probability is <= 1 - p (keeping the last)."""
    order = np.argsort(scaled, kind="stable")
    cum = np.cumsum(softmax(scaled[order]))
    drop = cum <= 1 - p
    drop[-1] = False
    out = scaled.copy()
    out[order[drop]] = -np.inf
    return out


def ref_filter(logits, temperature, min_p, top_k, top_p):
    return ref_top_p(ref_top_k(ref_min_p(logits / temperature, min_p), top_k), top_p)


def assert_same_masked(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=1e-6, atol=1e-6)


# ----- logits processing ---------------------------------------------------------------------------------


def test_penalties_match_numpy_reference():
    rng = np.random.default_rng(0)
    state = slot_state(rng)
    logits = rng.normal(0, 2, (5, V)).astype(np.float32)
    settings = [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.3), (-0.4, 0.3, 0.8), (0.0, 0.0, 1.0)]
    slots = [0, 1, 2, 3, None]
    rows = [row(presence=p, frequency=f, repetition=r, slot=s) for (p, f, r), s in zip(settings, slots, strict=True)]
    out = np.asarray(jax.jit(apply_penalties)(logits, tensors(rows), state))
    for i, ((p, f, r), s) in enumerate(zip(settings, slots, strict=True)):
        if s is None:  # no penalties, no slot: untouched
            np.testing.assert_array_equal(out[i], logits[i])
            continue
        counts, prompt = np.asarray(state.output_counts[s]), np.asarray(state.prompt_mask[s])
        np.testing.assert_allclose(out[i], ref_penalties(logits[i], counts, prompt, p, f, r), rtol=1e-6, atol=1e-6)
    assert not np.allclose(out[:4], logits[:4])  # the reference is not the identity on this data


def test_logit_bias_and_min_tokens_match_numpy_reference():
    rng = np.random.default_rng(1)
    state = slot_state(rng)
    logits = rng.normal(0, 2, (4, V)).astype(np.float32)
    rows = [
        row(slot=0, flags=FLAG_LOGIT_BIAS),  # bias only
        row(slot=1, min_tokens=3, step=1),  # before min_tokens: stop ids masked
        row(slot=2, min_tokens=3, step=3, flags=FLAG_LOGIT_BIAS),  # min_tokens reached: bias only
        row(slot=3),  # neither
    ]
    out = np.asarray(jax.jit(apply_bias_and_min_tokens)(logits, tensors(rows), state))
    bias, mask = np.asarray(state.logit_bias), np.asarray(state.min_tokens_mask)
    np.testing.assert_allclose(out[0], logits[0] + bias[0], rtol=1e-6)
    np.testing.assert_array_equal(out[1], np.where(mask[1], -np.inf, logits[1]))
    np.testing.assert_allclose(out[2], logits[2] + bias[2], rtol=1e-6)
    np.testing.assert_array_equal(out[3], logits[3])
    assert mask[1].any()


@pytest.mark.parametrize(
    "temperature, min_p, top_k, top_p",
    [(1.0, 0.0, 0, 1.0), (0.7, 0.1, 0, 1.0), (1.3, 0.0, 5, 1.0), (0.9, 0.0, 0, 0.8), (0.6, 0.02, 12, 0.9),
     (1.0, 0.3, 40, 0.5), (2.0, 0.0, 1, 1.0)],
)
@pytest.mark.parametrize("num_candidates", [256, 8])  # 8: the cutoff is often beyond the candidates
def test_temperature_min_p_top_k_top_p_match_numpy_reference(temperature, min_p, top_k, top_p, num_candidates):
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 2, (3, V)).astype(np.float32)
    rows = [row(temperature=temperature, min_p=min_p, top_p=top_p, top_k=top_k)] * 2
    rows.append(row(temperature=1.0))  # another row without filters is unaffected by this row's
    out = np.asarray(jax.jit(filter_logits, static_argnums=2)(logits, tensors(rows), num_candidates))
    for i in range(2):
        assert_same_masked(out[i], ref_filter(logits[i].astype(np.float64), temperature, min_p, top_k, top_p))
    np.testing.assert_allclose(out[2], logits[2], rtol=1e-6)


def test_cutoff_among_the_candidates_is_used_only_when_exact():
    rng = np.random.default_rng(9)
    logits = np.sort(rng.normal(0, 1, (5, V)).astype(np.float32), axis=-1)[:, ::-1]
    logits[2] *= 6.0  # peaked: top_p 0.5 ends within the first candidates
    vocab = V
    k = np.array([5, 12, vocab, vocab, vocab], np.int32)
    top_p = np.array([0.9, 0.9, 0.5, 0.999, 1.0], np.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    found, threshold = jax.jit(_prefix_cutoff, static_argnums=3)(logits[:, :8], k, top_p, vocab, lse)
    # top_k 5 <= 8: exact; top_k 12 > 8: its normalizer is unknown; a peaked top_p ends among the 8; a
    # flat top_p 0.999 does not; top_p 1 with top_k off filters nothing
    assert np.asarray(found).tolist() == [True, False, True, False, True]
    assert np.isneginf(np.asarray(threshold)[4])
    full = jax.jit(_prefix_cutoff, static_argnums=3)(logits, k, top_p, vocab, None)[1]
    np.testing.assert_array_equal(np.asarray(threshold)[[0, 2]], np.asarray(full)[[0, 2]])


def test_bisected_cutoff_equals_the_sorted_prefix_cutoff():
    """The fallback without a sort: on 200 rows of a 4096-token vocabulary (peaked and flat, with -inf entries as
    min_p leaves them, and rows of many tied values), each row's kept set under top-k and top-p is the numpy
    reference's (where tied values straddle the cutoff, all of them are kept: vLLM's top-p keeps those its sort
    puts first), and without ties the cutoff is exactly the sorted prefix's."""
    rng = np.random.default_rng(4)
    vocab, rows = 4096, 200
    logits = rng.normal(0, rng.uniform(0.3, 6.0, (rows, 1)), (rows, vocab)).astype(np.float32)
    logits[rng.random((rows, vocab)) < 0.2] = -np.inf
    ties = np.arange(rows) % 4 == 0
    logits[ties] = np.round(logits[ties] * 2) / 2  # a few dozen distinct values: ties at every cutoff
    k = rng.choice([1, 2, 50, 300, 3000, vocab], rows).astype(np.int32)
    top_p = rng.choice([0.05, 0.5, 0.9, 0.999, 1.0], rows).astype(np.float32)
    cutoff = np.asarray(jax.jit(_bisected_cutoff)(logits, k, top_p))
    descending = -np.sort(-logits, axis=-1)
    by_sort = np.asarray(jax.jit(_prefix_cutoff, static_argnums=3)(descending, k, top_p, vocab, None)[1])
    for i in range(rows):
        reference = ref_top_p(ref_top_k(logits[i].astype(np.float64), int(k[i]) % vocab), float(top_p[i]))
        finite = np.isfinite(logits[i])
        kept, ours = np.isfinite(reference), (logits[i] >= cutoff[i]) & finite
        np.testing.assert_array_equal(ours, kept | (finite & (logits[i] == cutoff[i])), err_msg=f"row {i}")
        assert cutoff[i] == logits[i][kept].min() or (kept == finite).all(), i
        if not ties[i]:
            assert cutoff[i] == by_sort[i] or (top_p[i] >= 1.0 and k[i] == vocab), i


def test_top_k_one_equals_greedy():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1, (8, V)).astype(np.float32)
    rows = [row(temperature=1.5, top_k=1, seed=seed, step=seed % 3) for seed in range(8)]
    out = jax.jit(sample, static_argnums=3)(logits, tensors(rows), SlotState.zeros(4, V), K)
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(-1))


def test_greedy_rows_take_the_argmax_of_the_processed_logits():
    rng = np.random.default_rng(4)
    state = slot_state(rng)
    logits = rng.normal(0, 1, (2, V)).astype(np.float32)
    rows = [row(repetition=2.0, presence=1.5, slot=0), row(slot=1, flags=FLAG_LOGIT_BIAS)]
    out = jax.jit(sample, static_argnums=3)(logits, tensors(rows), state, K)
    counts, prompt = np.asarray(state.output_counts[0]), np.asarray(state.prompt_mask[0])
    expected = [ref_penalties(logits[0], counts, prompt, 1.5, 0.0, 2.0).argmax(),
                (logits[1] + np.asarray(state.logit_bias[1])).argmax()]
    np.testing.assert_array_equal(np.asarray(out.tokens), expected)


@pytest.mark.parametrize(
    ("rows", "argmax_only"),
    [
        ([row(), row(step=3, min_tokens=3)], True),  # min_tokens reached: no longer in force
        ([row(), row(temperature=0.5)], False),
        ([row(), row(flags=FLAG_LOGPROBS)], False),
        ([row(flags=FLAG_LOGIT_BIAS)], False),
        ([row(flags=FLAG_GRAMMAR)], False),
        ([row(step=2, min_tokens=3)], False),
        ([row(repetition=1.1)], False),
        ([row(frequency=0.5)], False),
        ([row(presence=-0.5)], False),
    ],
)
def test_takes_argmax_only_exactly_when_sample_returns_the_raw_argmax(rows, argmax_only):
    """The host's check that picks the GPU's argmax-only sampler (`ModelRunner._sample_argmax`): true only where
    `sample` gives every row its raw logits' argmax and no logprobs; padding rows change nothing."""
    params = tensors(rows, batch_size=4)
    assert takes_argmax_only(params) is argmax_only
    if argmax_only:
        rng = np.random.default_rng(6)
        logits = rng.normal(0, 1, (4, V)).astype(np.float32)
        out = jax.jit(sample, static_argnums=3)(logits, params, slot_state(rng), K)
        np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(-1))
        assert not np.any(np.asarray(out.logprobs.token_logprob))


def test_a_batch_with_random_rows_samples_from_the_processed_logits():
    """Greedy and random rows beside a penalized and a biased row: the greedy rows take their processed argmax, the
    random rows draw from their processed logits with their own keys (the same tokens as `sample_random` on them),
    over 8 steps of draws, which differ from draws on the unprocessed logits."""
    rng = np.random.default_rng(5)
    state = slot_state(rng)
    logits = rng.normal(0, 1, (4, V)).astype(np.float32)
    counts, prompt = np.asarray(state.output_counts[0]), np.asarray(state.prompt_mask[0])
    greedy = [ref_penalties(logits[0], counts, prompt, 1.5, 0.0, 2.0).argmax(),
              (logits[1] + np.asarray(state.logit_bias[1])).argmax()]
    sampled, processed = jax.jit(sample, static_argnums=3), jax.jit(process_logits)
    drawn_from = jax.jit(sample_random)
    drawn_by_step, unprocessed_by_step = [], []
    for step in range(8):
        rows = [row(repetition=2.0, presence=1.5, slot=0), row(slot=1, flags=FLAG_LOGIT_BIAS),
                row(temperature=0.9, top_p=0.8, repetition=1.5, slot=2, seed=7, step=step),
                row(temperature=1.2, top_k=20, slot=3, seed=11, step=step, flags=FLAG_LOGIT_BIAS)]
        params = tensors(rows)
        out = sampled(logits, params, state, K)
        drawn = np.asarray(drawn_from(processed(logits, params, state), params))
        np.testing.assert_array_equal(np.asarray(out.tokens), [*greedy, *drawn[2:]])
        drawn_by_step.append(drawn[2:])
        unprocessed_by_step.append(np.asarray(drawn_from(jnp.asarray(logits), params))[2:])
    assert not np.array_equal(drawn_by_step, unprocessed_by_step)  # the processing shows


def test_sampled_frequencies_follow_the_filtered_distribution():
    """4096 draws with fixed seeds (deterministic) from one row's distribution over 8 tokens."""
    logits = np.log(np.array([0.30, 0.25, 0.15, 0.12, 0.08, 0.05, 0.03, 0.02], np.float32))
    n = 4096
    rows = [row(temperature=1.0, top_k=6, top_p=0.9, seed=1234, step=i) for i in range(n)]
    out = jax.jit(sample, static_argnums=3)(np.tile(logits, (n, 1)), tensors(rows), SlotState.zeros(1, 8), 4)
    freq = np.bincount(np.asarray(out.tokens), minlength=8) / n
    expected = softmax(ref_filter(logits.astype(np.float64), 1.0, 0.0, 6, 0.9))
    assert expected[5:].sum() == 0  # top_p 0.9 keeps the first five tokens
    np.testing.assert_allclose(freq, expected, atol=0.025)


def test_inverse_cdf_draw_returns_numpy_searchsorted_index_and_never_a_zero_weight():
    """Two-level draw (block sums, then one block) against a flat cumulative sum, over 1000 entries (four blocks,
    the last one padded) with zero-weight runs, uniforms at 0 and just below 1 included."""
    rng = np.random.default_rng(11)
    weights = rng.random((3, 1000)).astype(np.float32) * (rng.random((3, 1000)) < 0.4)
    weights[1, :600] = 0.0  # whole blocks of zeros before the mass
    weights[2, 17:] = 0.0  # all the mass in the first block
    uniforms = np.concatenate([rng.random((3, 61)), np.zeros((3, 1)), np.full((3, 1), 1 - 2**-24)], axis=1)
    tokens = np.asarray(jax.jit(inverse_cdf_draw)(weights, uniforms.astype(np.float32)))
    for r in range(3):
        cdf = np.cumsum(weights[r].astype(np.float64))
        expected = np.minimum(np.searchsorted(cdf, uniforms[r] * cdf[-1], side="right"), np.flatnonzero(weights[r])[-1])
        assert np.all(weights[r, tokens[r]] > 0)
        assert np.mean(tokens[r] == expected) >= 0.95  # float32 sums may move a draw at a boundary to its neighbour
        assert np.all(np.abs(cdf[tokens[r]] - uniforms[r] * cdf[-1]) <= weights[r, tokens[r]] + 1e-4 * cdf[-1])


def test_first_argmax_equals_numpy_argmax_with_ties_and_infinities():
    x = np.array([[1.0, 3.0, 3.0, -np.inf], [-np.inf] * 4, [0.0, -1.0, 2.0, 2.0], [5.0, 5.0, 5.0, 5.0]], np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(first_argmax)(x)), np.argmax(x, axis=-1))


def test_tiny_top_p_keeps_only_the_most_likely_token_through_the_exact_fallback():
    """top_p near 0: the nucleus is the top token, which the draws almost never hit on this flat row (1/64 per
    draw): every row exhausts its redraws and takes the exact cutoff's token, the argmax."""
    rng = np.random.default_rng(12)
    logits = rng.normal(0, 0.01, (16, V)).astype(np.float32)
    rows = [row(temperature=1.0, top_p=1e-6, seed=seed, step=1) for seed in range(16)]
    out = jax.jit(sample, static_argnums=3)(logits, tensors(rows), SlotState.zeros(4, V), K)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.argmax(logits, axis=-1))


@pytest.mark.parametrize(("temperature", "min_p", "top_k", "top_p"), [(1.0, 0.0, 0, 0.7), (0.7, 0.2, 0, 1.0),
                                                                    (1.3, 0.0, 12, 0.8), (1.0, 0.0, 0, 1.0)])
def test_sampled_frequencies_over_a_wide_row_follow_the_reference_filter(temperature, min_p, top_k, top_p):
    """8192 seeded draws from one 64-token row: frequencies within 0.02 of the numpy reference's distribution,
    tokens outside it never drawn."""
    logits = np.random.default_rng(13).normal(0, 1.5, V).astype(np.float32)
    n = 8192
    rows = [row(temperature=temperature, min_p=min_p, top_k=top_k, top_p=top_p, seed=99, step=i) for i in range(n)]
    out = jax.jit(sample, static_argnums=3)(np.tile(logits, (n, 1)), tensors(rows), SlotState.zeros(1, V), 4)
    freq = np.bincount(np.asarray(out.tokens), minlength=V) / n
    expected = softmax(ref_filter(logits.astype(np.float64), temperature, min_p, top_k, top_p))
    assert np.all(freq[expected == 0] == 0)
    np.testing.assert_allclose(freq, expected, atol=0.02)


def test_seeded_row_samples_the_same_token_alone_and_in_any_batch():
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 1, (8, V)).astype(np.float32)
    mine = row(temperature=0.9, top_p=0.95, top_k=30, seed=77, step=4)
    run = jax.jit(sample, static_argnums=3)
    alone = run(logits[3:4], tensors([mine]), SlotState.zeros(4, V), K).tokens
    others = [row(temperature=1.0 + 0.1 * i, seed=i, step=i, top_k=i) for i in range(8)]
    for position in (0, 3, 7):
        batch_rows = others[:position] + [mine] + others[position + 1 :]
        batch_logits = np.concatenate([logits[:position], logits[3:4], logits[position + 1 :]])
        batched = run(batch_logits, tensors(batch_rows), SlotState.zeros(4, V), K).tokens
        assert int(batched[position]) == int(alone[0])
    steps = [int(run(logits[3:4], tensors([row(temperature=1.0, seed=77, step=s)]), SlotState.zeros(4, V), K)
                 .tokens[0]) for s in range(12)]
    assert len(set(steps)) > 3  # the step is folded into the key: successive tokens are fresh draws


# ----- logprobs --------------------------------------------------------------------------------------


def test_logprobs_are_the_log_softmax_of_the_raw_logits():
    rng = np.random.default_rng(6)
    state = slot_state(rng)
    logits = rng.normal(0, 2, (3, V)).astype(np.float32)
    rows = [row(repetition=1.5, slot=0, flags=FLAG_LOGPROBS),  # penalties do not change logprobs
            row(temperature=0.8, seed=3, slot=1, flags=FLAG_LOGPROBS | FLAG_LOGIT_BIAS),
            row(flags=FLAG_LOGPROBS)]
    out = jax.jit(sample, static_argnums=3)(logits, tensors(rows), state, K)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    tokens = np.asarray(out.tokens)
    order = np.argsort(-ref, axis=-1)
    lp = out.logprobs
    np.testing.assert_array_equal(np.asarray(lp.top_ids), order[:, :K])
    np.testing.assert_allclose(np.asarray(lp.top_logprobs), np.take_along_axis(ref, order[:, :K], -1), atol=1e-5)
    np.testing.assert_allclose(np.asarray(lp.token_logprob), ref[np.arange(3), tokens], atol=1e-5)
    ranks = [int(np.sum(ref[i] >= ref[i, tokens[i]])) for i in range(3)]
    np.testing.assert_array_equal(np.asarray(lp.token_rank), ranks)
    assert int(lp.token_rank[2]) == 1


def test_no_logprobs_requested_returns_zeros():
    logits = np.random.default_rng(7).normal(0, 1, (2, V)).astype(np.float32)
    out = jax.jit(sample, static_argnums=3)(logits, tensors([row(), row()]), SlotState.zeros(4, V), K)
    assert not np.any(np.asarray(out.logprobs.top_logprobs)) and not np.any(np.asarray(out.logprobs.token_rank))


@pytest.mark.parametrize("q", [64, 48, 8])
def test_prompt_logprobs_over_chunks_equal_a_direct_log_softmax(q):
    rng = np.random.default_rng(8)
    s, h = 2, 16
    hidden = rng.normal(0, 1, (s, q, h)).astype(np.float32)
    weight = rng.normal(0, 1, (h, V)).astype(np.float32)
    input_ids = rng.integers(0, V, (s, q)).astype(np.int32)
    num_tokens = np.array([q, q - 3], np.int32)
    next_token = np.array([5, 9], np.int32)
    meta = AttentionMetadata(np.zeros((s, 1), np.int32), np.zeros(s, np.int32), num_tokens)
    targets = np.asarray(prompt_targets(input_ids, token_layout(meta, (s, q)), num_tokens, next_token))
    np.testing.assert_array_equal(targets[0], np.append(input_ids[0, 1:], 5))
    np.testing.assert_array_equal(targets[1, : q - 4], input_ids[1, 1 : q - 3])
    assert targets[1, q - 4] == 9
    structs = PromptPositions.abstract(150, h, jnp.float32)
    assert structs.hidden.shape == (160, h)  # a whole number of chunks
    ones = PromptPositions(jnp.ones((160, h), jnp.float32), jnp.ones(160, jnp.int32))  # an earlier step's
    positions = jax.jit(PromptPositions.written)(ones, hidden, targets)
    out = jax.jit(lambda p, n: prompt_logprobs(p, n, lambda x: x @ weight, K))(positions, np.int32(s * q))
    direct = token_logprobs(jnp.asarray(hidden @ weight).reshape(s * q, V), jnp.asarray(targets).reshape(-1), K)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(direct), strict=True):
        assert a.shape[0] == 160 and a.shape[1:] == b.shape[1:]
        np.testing.assert_allclose(np.asarray(a)[: s * q], np.asarray(b), rtol=1e-5, atol=1e-5)
        last_chunk_end = -(-s * q // PROMPT_LOGPROBS_CHUNK) * PROMPT_LOGPROBS_CHUNK
        assert not np.any(np.asarray(a)[last_chunk_end:])  # chunks past the step's positions: not computed


# ----- per-slot state ----------------------------------------------------------------------------------


def test_update_token_counts_matches_numpy():
    num_slots = 3
    state = SlotState.zeros(num_slots, V)
    state = state.replace(output_counts=state.output_counts.at[1, 7].set(4).at[2, 9].set(2),
                          prompt_mask=state.prompt_mask.at[2, 11].set(True))
    input_ids = np.array([[3, 4, 3, 5, 6, 6], [8, 0, 0, 0, 0, 0], [12, 13, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], np.int32)
    q_start = np.array([0, 10, 0, 0], np.int32)
    lengths = np.array([6, 11, 2, 6], np.int32)  # row 0: whole chunk, row 1: one decode token, row 2: 2 tokens
    prompt_len = np.array([4, 5, 1, 6], np.int32)
    slots = np.array([0, 1, 2, num_slots], np.int32)  # row 3 has no slot
    meta = AttentionMetadata(np.zeros((4, 1), np.int32), q_start, lengths)
    out = jax.jit(update_token_counts)(state, input_ids, token_layout(meta, input_ids.shape), prompt_len, slots)
    _check_counts(out, num_slots)


def test_update_token_counts_on_a_ragged_step_counts_the_same():
    """The same four rows as above, back to back in a flat [1, T] step (row 3 and a padding row hold no slot)."""
    num_slots = 3
    state = SlotState.zeros(num_slots, V)
    state = state.replace(output_counts=state.output_counts.at[1, 7].set(4).at[2, 9].set(2),
                          prompt_mask=state.prompt_mask.at[2, 11].set(True))
    input_ids = np.array([[3, 4, 3, 5, 6, 6, 8, 12, 13, 1, 1, 1, 1, 1, 1, 7, 7]], np.int32)  # 2 padding tokens
    query_starts = np.array([0, 6, 7, 9, 17], np.int32)
    q_start = np.array([0, 10, 0, 0, 0], np.int32)
    lengths = np.array([6, 11, 2, 6, 0], np.int32)
    prompt_len = np.array([4, 5, 1, 6, 0], np.int32)
    slots = np.array([0, 1, 2, num_slots, num_slots], np.int32)
    meta = AttentionMetadata(np.zeros((5, 1), np.int32), q_start, lengths, query_starts)
    out = jax.jit(update_token_counts)(state, input_ids, token_layout(meta, input_ids.shape), prompt_len, slots)
    _check_counts(out, num_slots)


def test_a_step_scatters_no_bool_array():
    """The step only scatter-adds generated tokens into the i32 counts; the prompt mask comes with the slot.
    A scatter into a bool [N, V] array costs 20-40 s of every TPU step's compile at a 128k vocabulary."""
    state = SlotState.abstract(4, V)
    input_ids = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    meta = AttentionMetadata(np.zeros((2, 1), np.int32), np.zeros(2, np.int32), np.full(2, 8, np.int32))
    layout = token_layout(meta, input_ids.shape)
    text = jax.jit(update_token_counts).lower(state, input_ids, layout, np.zeros(2, np.int32),
                                              np.zeros(2, np.int32)).as_text()
    scattered = re.findall(r'"stablehlo.scatter".*?\}\) : \(tensor<([^>]*)>', text, re.S)  # operand types
    assert scattered == [f"4x{V}xi32"]


def _check_counts(out, num_slots):
    counts, prompt = np.zeros((num_slots, V), np.int32), np.zeros((num_slots, V), bool)
    counts[1, 7] = 4  # row 1 continues (q_start 10): kept, plus its generated token 8
    counts[1, 8] = 1
    counts[0, 6] = 2  # row 0: positions 0-3 are prompt (not counted), 4-5 generated (token 6 twice)
    counts[2, 9], prompt[2, 11] = 2, True  # earlier counts stay (write_slot resets a slot, not the step)
    counts[2, 13] = 1  # row 2: a one-token prompt, then one generated token
    np.testing.assert_array_equal(np.asarray(out.output_counts), counts)
    # the prompt mask is written with the slot (the whole prompt, `write_slot`): steps leave it alone
    np.testing.assert_array_equal(np.asarray(out.prompt_mask), prompt)


def _bitmask(allowed_tokens: list[int]) -> np.ndarray:
    words = np.zeros(bitmask_words(V), np.uint32)
    for token in allowed_tokens:
        words[token // 32] |= np.uint32(1) << np.uint32(token % 32)
    return words.view(np.int32)


def test_a_grammar_bitmask_masks_its_row_only():
    """Greedy and random constrained rows only pick allowed tokens (token 33 sits in the second word, token 31
    in the sign bit of the first); an unconstrained row beside them is untouched; logprobs stay raw."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, V)).astype(np.float32)
    allowed = [31, 33, 50]
    rows = [row(flags=FLAG_GRAMMAR | FLAG_LOGPROBS, allowed=_bitmask(allowed)),
            row(temperature=1.0, seed=4, flags=FLAG_GRAMMAR, allowed=_bitmask(allowed)), row()]
    run = jax.jit(sample, static_argnums=3)
    out = run(logits, tensors(rows), SlotState.zeros(4, V), K)
    tokens = np.asarray(out.tokens)
    assert tokens[0] == allowed[int(np.argmax(logits[0, allowed]))]
    assert tokens[1] in allowed and tokens[2] == int(np.argmax(logits[2]))
    raw = logits[0] - np.log(np.exp(logits[0]).sum())
    assert float(out.logprobs.token_logprob[0]) == pytest.approx(raw[tokens[0]], abs=1e-5)
    for seed in range(20):  # random draws never leave the mask
        rows[1] = row(temperature=1.0, seed=seed, flags=FLAG_GRAMMAR, allowed=_bitmask(allowed))
        assert int(run(logits, tensors(rows), SlotState.zeros(4, V), K).tokens[1]) in allowed


def test_write_and_copy_slots():
    state = SlotState.zeros(3, V)
    state = state.replace(output_counts=state.output_counts.at[1, 3].set(5).at[0, 3].set(1),
                          prompt_mask=state.prompt_mask.at[1, 2].set(True))
    bias = np.arange(V, dtype=np.float32)
    mask = np.arange(V) % 5 == 0
    zeros = np.zeros(V, np.int32)
    state = jax.jit(write_slot)(state, np.int32(1), bias, mask, zeros, zeros.astype(bool))
    assert not np.any(np.asarray(state.output_counts[1])) and not np.any(np.asarray(state.prompt_mask[1]))
    assert int(state.output_counts[0, 3]) == 1  # other slots are untouched
    state = state.replace(output_counts=state.output_counts.at[1, 4].set(2))
    copied = jax.jit(copy_slots)(state, np.array([1, 0], np.int32), np.array([2, 3], np.int32))  # 3: no-op
    for field in ("output_counts", "prompt_mask", "logit_bias", "min_tokens_mask"):
        np.testing.assert_array_equal(np.asarray(getattr(copied, field))[2], np.asarray(getattr(state, field))[1])
        np.testing.assert_array_equal(np.asarray(getattr(copied, field))[:2], np.asarray(getattr(state, field))[:2])
    np.testing.assert_array_equal(np.asarray(copied.logit_bias[1]), bias)


def test_write_slot_sets_the_counts_of_a_cached_prefix():
    """A slot taken after a prefix cache hit starts with its skipped tokens' counts, written from the host."""
    state = SlotState.zeros(2, V)
    counts = np.zeros(V, np.int32)
    counts[[4, 9]] = [2, 1]
    prompt = np.arange(V) < 3
    state = jax.jit(write_slot)(state, np.int32(0), np.zeros(V, np.float32), np.zeros(V, bool), counts, prompt)
    np.testing.assert_array_equal(np.asarray(state.output_counts[0]), counts)
    np.testing.assert_array_equal(np.asarray(state.prompt_mask[0]), prompt)
    assert not np.any(np.asarray(state.output_counts[1]))


def test_slot_table_hands_out_and_takes_back():
    table = SlotTable(2)
    assert (table.assign(10), table.assign(11), table.num_free, table.no_slot) == (0, 1, 0, 2)
    with pytest.raises(RuntimeError, match="no free sampler slot: all 2 are held"):
        table.assign(12)
    with pytest.raises(RuntimeError, match="seq 10 already holds sampler slot 0"):
        table.assign(10)
    table.release(10)
    table.release(10)  # releasing twice is harmless
    assert (table.get(10), table.assign(12), table.get(11)) == (None, 0, 1)


def test_padding_rows_are_greedy_and_slotless():
    t = tensors([row(temperature=0.5, seed=2**32 - 1, slot=1)], batch_size=3, num_slots=4)
    assert np.asarray(t.floats)[1:].tolist() == [list(PAD_FLOATS)] * 2
    assert np.asarray(t.slot).tolist() == [1, 4, 4]
    assert int(np.asarray(jax.jit(lambda x: x.seed)(t))[0]) == 2**32 - 1  # a u32 seed survives the i32 column


def test_the_exact_fallbacks_nucleus_is_the_reference_filters():
    """A row whose draws all missed draws from `nucleus_weights`: over rows of every temperature, min_p, top_k and
    top_p mix (peaked and flat rows, tied values), the tokens it keeps are the numpy reference's, and where tied
    values straddle the cutoff all of them (as `filter_logits` keeps them)."""
    rng = np.random.default_rng(6)
    settings = [(t, m, k, p) for t in (0.7, 1.3) for m in (0.0, 0.1) for k in (0, 5) for p in (0.05, 0.5, 0.9, 1.0)]
    logits = rng.normal(0, rng.uniform(0.3, 6.0, (len(settings), 1)), (len(settings), V)).astype(np.float32)
    ties = np.arange(len(settings)) % 4 == 0
    logits[ties] = np.round(logits[ties] * 2) / 2
    rows = [row(temperature=t, min_p=m, top_k=k, top_p=p) for t, m, k, p in settings]
    nucleus = jax.jit(lambda x, params: nucleus_draw(x, params).nucleus_weights())(logits, tensors(rows))
    kept = np.asarray(nucleus) > 0
    for i, (temperature, min_p, top_k, top_p) in enumerate(settings):
        reference = np.isfinite(ref_filter(logits[i].astype(np.float64), temperature, min_p, top_k, top_p))
        smallest = logits[i][reference].min()
        np.testing.assert_array_equal(kept[i], reference | (kept[i] & (logits[i] == smallest)), err_msg=f"row {i}")


def test_a_rows_uniforms_depend_on_its_seed_step_and_draw_number_only():
    """Counter-based draws: a (seed, step) pair gets the same uniforms in any row of any batch, another seed, step or
    first draw number other ones; 4096 x 33 of them are uniform on [0, 1) (mean and deciles within 0.01)."""
    pairs = [(5, 0), (5, 1), (6, 0), (5, 0)]
    draws = np.asarray(jax.jit(uniforms, static_argnums=(1, 2))(tensors([row(seed=s, step=n) for s, n in pairs]), 0, 4))
    np.testing.assert_array_equal(draws[0], draws[3])
    assert len({tuple(d) for d in draws[:3]}) == 3
    later = np.asarray(jax.jit(uniforms, static_argnums=(1, 2))(tensors([row(seed=5, step=0)]), 2, 2))
    np.testing.assert_array_equal(later[0], draws[0, 2:])
    many = np.asarray(jax.jit(uniforms, static_argnums=(1, 2))(
        tensors([row(seed=s, step=s % 7) for s in range(4096)]), 0, 33)).ravel()
    assert many.min() >= 0.0 and many.max() < 1.0
    assert abs(many.mean() - 0.5) < 0.01
    np.testing.assert_allclose(np.quantile(many, np.linspace(0.1, 0.9, 9)), np.linspace(0.1, 0.9, 9), atol=0.01)
