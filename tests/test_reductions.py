"""jaxserve/reductions.py: exact counts and index searches in float32, each one kernel on XLA:CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.reductions import EXACT_LIMIT, count_true, first_true, last_true

VOCAB = 49152


def _masks(seed: int = 0) -> np.ndarray:
    """[5, VOCAB] rows: sparse, dense, none, all, and only the last entry."""
    rng = np.random.default_rng(seed)
    masks = np.stack([rng.random(VOCAB) < 0.001, rng.random(VOCAB) < 0.7, np.zeros(VOCAB, bool),
                      np.ones(VOCAB, bool), np.zeros(VOCAB, bool)])
    masks[4, -1] = True
    return masks


def test_counts_are_exact_along_either_axis():
    masks = _masks()
    np.testing.assert_array_equal(count_true(jnp.asarray(masks)), masks.sum(-1))
    np.testing.assert_array_equal(count_true(jnp.asarray(masks), axis=0), masks.sum(0))
    assert count_true(jnp.asarray(masks)).dtype == jnp.int32


def test_first_and_last_indices_are_exact_and_past_the_ends_where_nothing_is_true():
    masks = _masks(1)
    first = [int(np.flatnonzero(m)[0]) if m.any() else VOCAB for m in masks]
    last = [int(np.flatnonzero(m)[-1]) if m.any() else -1 for m in masks]
    np.testing.assert_array_equal(first_true(jnp.asarray(masks)), first)
    np.testing.assert_array_equal(last_true(jnp.asarray(masks)), last)
    assert (first[2:], last[2:]) == ([VOCAB, 0, VOCAB - 1], [-1, VOCAB - 1, VOCAB - 1])


def test_more_entries_than_float32_counts_exactly_is_refused():
    too_long = jax.ShapeDtypeStruct((1, EXACT_LIMIT + 1), jnp.bool_)
    message = f"a float32 count or index over {EXACT_LIMIT + 1} entries is not exact"
    for reduce in (count_true, first_true, last_true):
        with pytest.raises(ValueError, match=message):
            jax.eval_shape(reduce, too_long)


def test_a_count_over_a_vocabulary_compiles_to_one_reduction_where_an_int32_sum_is_split():
    """The reason for the module: XLA:CPU splits the int32 sum into reduce-windows of 32 (three kernels)."""
    mask = jax.ShapeDtypeStruct((64, VOCAB), jnp.bool_)
    compiled = lambda f: jax.jit(f).lower(mask).compile().as_text()  # noqa: E731
    assert "reduce-window" in compiled(lambda m: jnp.sum(m, axis=-1, dtype=jnp.int32))
    assert "reduce-window" not in compiled(count_true)
    assert "reduce-window" not in compiled(first_true)
