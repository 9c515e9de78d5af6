"""Draft verification on the device (`runner/spec_verify.py`) over hand-made logits: greedy acceptance, exact
rejection sampling (the kept token is distributed as the filtered target distribution), penalties that see only
the drafts before a position, and the slot counts of rejected drafts taken back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from jaxserve.runner.sampler import FLAG_LOGPROBS, SamplingRow, SamplingTensors
from jaxserve.runner.sampler_state import SlotState
from jaxserve.runner.spec_verify import VerifyInputs, uncount_rejected, verify

V = 8
K = 3
GREEDY = (0.0, 1.0, 0.0, 0.0, 0.0, 1.0)


def _inputs(drafts: list[list[int]], batch_size: int, num_positions: int) -> VerifyInputs:
    """Rows that are decode rows: the last token and the drafts, back to back."""
    starts = list(np.cumsum([0] + [len(d) + 1 for d in drafts[:-1]]))
    sizes = [len(d) + 1 for d in drafts]
    return VerifyInputs.from_rows(starts, sizes, drafts, num_positions, batch_size, K)


def _run(logits, rows, drafts, slots=None, num_positions=None):
    s = len(rows)
    p = num_positions or sum(len(d) + 1 for d in drafts)
    inputs = _inputs(drafts, s, p)
    sampling = SamplingTensors.from_rows(rows, s, 1, V)
    slots = slots if slots is not None else SlotState.zeros(1, V)
    logits = np.pad(logits, ((0, p - len(logits)), (0, 0)))  # padding positions
    out = jax.jit(verify, static_argnums=4)(jnp.asarray(logits, jnp.float32), sampling, slots, inputs, 2)
    return out, inputs, sampling


def _one_hot_logits(tokens: list[int]) -> np.ndarray:
    logits = np.zeros((len(tokens), V), np.float32)
    logits[np.arange(len(tokens)), tokens] = 5.0
    return logits


def test_greedy_rows_accept_their_leading_argmax_drafts_and_take_the_argmax_after():
    # row 0: argmaxes 4, 5, 6, 7 and drafts 4, 5, 1: two accepted, then the argmax 6
    # row 1: drafts 2, 2, 2 against argmaxes 3, ...: none accepted, the argmax 3
    # row 2: every draft right: all three accepted, the bonus argmax 1
    # row 3: no drafts: its argmax, as a plain step
    argmaxes = [4, 5, 6, 7] + [3, 0, 0, 0] + [7, 6, 5, 1] + [2]
    drafts = [[4, 5, 1], [2, 2, 2], [7, 6, 5], []]
    rows = [SamplingRow(GREEDY, flags=FLAG_LOGPROBS)] * 4
    out, _, _ = _run(_one_hot_logits(argmaxes), rows, drafts, num_positions=16)
    assert out.num_accepted.tolist() == [2, 0, 3, 0]
    assert out.tokens.tolist() == [6, 3, 1, 2]
    logprobs = np.asarray(out.logprobs.token_logprob)  # of the token kept at each position (0 past a row's end)
    kept = np.log(np.exp(5.0) / (np.exp(5.0) + V - 1))
    np.testing.assert_allclose(logprobs[[0, 1, 2, 4, 8, 9, 10, 11, 12]], kept, rtol=1e-5)


def _filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The target distribution: temperature, then top-k, then top-p over the top-k distribution (no ties)."""
    scaled = logits / temperature
    order = np.argsort(-scaled)
    keep = np.zeros(V, bool)
    keep[order[:top_k]] = True
    probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    cumulative_before = np.cumsum(probs[order]) - probs[order]
    nucleus = np.zeros(V, bool)
    nucleus[order[cumulative_before < top_p]] = True
    probs = np.where(nucleus, probs, 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize("draft", [1, 6])  # the most likely token, and one outside the nucleus
def test_random_rows_keep_a_token_distributed_as_the_filtered_target(draft):
    """Over 6000 seeds: the first token a row keeps (its draft when accepted, else the residual sample) follows the
    target distribution after temperature, top-k and top-p exactly (chi-square), and the draft is accepted with
    its target probability."""
    logits = np.array([0.3, 2.0, 1.4, -1.0, 0.9, 1.1, -0.5, 0.0], np.float32)
    temperature, top_k, top_p = 0.8, 6, 0.9
    n = 6000
    rows = [SamplingRow((temperature, top_p, 0.0, 0.0, 0.0, 1.0), top_k=top_k, seed=seed, step=3)
            for seed in range(n)]
    out, _, _ = _run(np.tile(logits, (2 * n, 1)), rows, [[draft]] * n)
    accepted = np.asarray(out.num_accepted) == 1
    first = np.where(accepted, draft, np.asarray(out.tokens))
    expected = _filtered_probs(logits.astype(np.float64), temperature, top_k, top_p)
    observed = np.bincount(first, minlength=V)
    support = expected > 0
    assert not observed[~support].any()
    assert chisquare(observed[support], n * expected[support]).pvalue > 1e-3
    assert abs(accepted.mean() - expected[draft]) < 4 * np.sqrt(expected[draft] * (1 - expected[draft]) / n) + 1e-9


def test_a_row_without_drafts_samples_what_a_plain_step_samples():
    from jaxserve.runner.sampler import sample

    logits = np.random.default_rng(0).normal(size=(5, V)).astype(np.float32)
    rows = [SamplingRow((1.0, 0.8, 0.0, 0.0, 0.0, 1.0), top_k=5, seed=seed, step=7) for seed in range(5)]
    out, _, sampling = _run(logits, rows, [[]] * 5)
    plain = sample(jnp.asarray(logits), sampling, SlotState.zeros(1, V), 2)
    assert out.tokens.tolist() == plain.tokens.tolist()
    assert out.num_accepted.tolist() == [0] * 5


def _fed_slots(drafts: list[int]) -> SlotState:
    """Slot 0 as the step leaves it before sampling: its fed drafts counted (`update_token_counts`)."""
    counts = np.bincount(drafts, minlength=V).astype(np.int32)[None]
    return SlotState.zeros(1, V).replace(output_counts=jnp.asarray(counts))


def test_penalties_see_only_the_drafts_before_each_position_and_rejected_drafts_leave_the_counts():
    """A frequency penalty of 10: position j must see only the drafts before it, though the slot counts hold all."""
    logits = np.zeros((4, V), np.float32)
    logits[:, 2] = logits[:, 3] = 3.0  # without the penalty, 2 and 3 win (the first argmax: 2)
    logits[:, 4] = 2.0
    row = SamplingRow((0.0, 1.0, 0.0, 0.0, 10.0, 1.0), slot=0)
    # position 0 sees no draft: argmax 2 == draft, accepted; position 1 sees 2: argmax 3 == draft, accepted;
    # position 2 sees 2 and 3: argmax 4 == draft, accepted; the bonus position sees all three: argmax 0
    out, _, _ = _run(logits, [row], [[2, 3, 4]], slots=_fed_slots([2, 3, 4]))
    assert out.num_accepted.tolist() == [3] and out.tokens.tolist() == [0]
    # drafts 2, 2, 4: position 1 sees one 2: argmax 3, not the draft 2: one accepted, then 3
    fed = _fed_slots([2, 2, 4])
    out, inputs, sampling = _run(logits, [row], [[2, 2, 4]], slots=fed)
    assert out.num_accepted.tolist() == [1] and out.tokens.tolist() == [3]
    after = uncount_rejected(fed, sampling, inputs, out.num_accepted)
    assert np.asarray(after.output_counts)[0].tolist() == np.bincount([2], minlength=V).tolist()  # the kept draft


def test_verify_inputs_lay_out_rows_and_reject_too_many_positions():
    inputs = VerifyInputs.from_rows([0, 3, 4], [3, 1, 6], [[7, 8], [], []], 8, 4, K)
    assert inputs.flat_index.tolist() == [0, 1, 2, 3, 9, 0, 0, 0]
    assert inputs.row.tolist() == [0, 0, 0, 1, 2, 4, 4, 4]
    assert inputs.offset.tolist() == [0, 1, 2, 0, 0, 0, 0, 0]
    assert inputs.draft.tolist() == [7, 8, -1, -1, -1, -1, -1, -1]
    assert inputs.row_positions.tolist() == [[0, 1, 2, 8], [3, 8, 8, 8], [4, 8, 8, 8], [8, 8, 8, 8]]
    with pytest.raises(ValueError, match="^7 sample positions do not fit the step's 5$"):
        VerifyInputs.from_rows([0, 3, 4], [3, 1, 3], [[7, 8], [], [1, 2]], 5, 4, K)
