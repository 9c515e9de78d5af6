"""The n-gram prompt-lookup proposer: hand-made sequences with exact drafts, constructor validation, and a
randomized comparison against a plain-Python reference of the same semantics."""

import numpy as np
import pytest

from jaxserve.speculative.ngram import NgramProposer


def propose(tokens, k=5, lo=1, hi=3, max_drafts=None):
    return NgramProposer(k, lo, hi).propose(tokens, max_drafts)


def test_longest_match_preferred_over_shorter_earlier_one():
    # suffix [1, 2, 3]: the 2-gram [2, 3] first occurs at 1..2, the 3-gram only at 5..7
    tokens = [4, 2, 3, 10, 11, 1, 2, 3, 20, 21, 1, 2, 3]
    assert propose(tokens, k=2, lo=1, hi=3) == [20, 21]
    assert propose(tokens, k=2, lo=1, hi=2) == [10, 11]  # max caps n at 2: the earliest [2, 3] wins


def test_earliest_occurrence_when_several():
    tokens = [5, 6, 1, 5, 6, 2, 5, 6, 3, 5, 6]
    assert propose(tokens, k=1, lo=2, hi=2) == [1]
    assert propose(tokens, k=4, lo=1, hi=4) == [1, 5, 6, 2]


def test_suffix_shorter_than_min_never_matches():
    tokens = [7, 8, 1, 9, 1]  # [9, 1] never occurred before; [1] did
    assert propose(tokens, lo=2, hi=3) == []
    assert propose(tokens, k=3, lo=1, hi=3) == [9, 1]


def test_num_speculative_tokens_and_max_drafts_cap():
    tokens = [1, 2, 3, 4, 5, 6, 7, 1]
    assert propose(tokens, k=3) == [2, 3, 4]
    assert propose(tokens, k=3, max_drafts=2) == [2, 3]
    assert propose(tokens, k=3, max_drafts=10) == [2, 3, 4]
    assert propose(tokens, k=3, max_drafts=0) == []
    assert propose(tokens, k=3, max_drafts=-1) == []


def test_no_match_gives_nothing():
    assert propose([1, 2, 3, 4]) == []
    assert propose([]) == []
    assert propose([5]) == []


def test_match_near_the_end_gives_fewer_tokens():
    assert propose([1, 2, 3, 1, 2], k=5, lo=2, hi=2) == [3, 1, 2]
    assert propose([7, 7, 7], k=5, lo=2, hi=2) == [7]  # overlapping occurrence 0..1, one token after it


def test_suffix_never_matches_its_own_position():
    assert propose([1, 2, 3], lo=1, hi=3) == []
    assert propose([5, 5], lo=2, hi=2) == []  # the only 2-gram is the suffix itself
    assert propose([5, 5], lo=1, hi=2) == [5]


def test_ndarray_input_gives_python_ints():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1]
    for dtype in (np.int32, np.int64):
        drafts = propose(np.array(tokens, dtype=dtype), k=3)
        assert drafts == [4, 1, 5]
        assert all(type(t) is int for t in drafts)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 1, 3), "num_speculative_tokens must be an integer >= 1, got 0"),
        ((5, 0, 3), "prompt_lookup_min must be an integer >= 1, got 0"),
        ((5, 1, -1), "prompt_lookup_max must be an integer >= 1, got -1"),
        ((5, 1.5, 3), "prompt_lookup_min must be an integer >= 1, got 1.5"),
        ((5, 4, 2), r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"),
    ],
)
def test_bad_constructor_args(args, message):
    with pytest.raises(ValueError, match=message):
        NgramProposer(*args)


def reference(tokens, k, lo, hi, max_drafts):
    """Largest n in [lo, hi] whose suffix n-gram occurs starting before the suffix; the tokens after the first."""
    k = k if max_drafts is None else min(k, max_drafts)
    if k <= 0:
        return []
    for n in range(hi, lo - 1, -1):
        suffix = tokens[len(tokens) - n :] if n <= len(tokens) else None
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_matches_reference_on_random_sequences():
    rng = np.random.default_rng(0)
    matched = 0
    for _ in range(200):
        tokens = rng.integers(0, rng.integers(2, 5), size=rng.integers(0, 48)).tolist()
        k, lo = int(rng.integers(1, 7)), int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        max_drafts = None if rng.random() < 0.5 else int(rng.integers(-1, 8))
        expected = reference(tokens, k, lo, hi, max_drafts)
        assert NgramProposer(k, lo, hi).propose(tokens, max_drafts) == expected, (tokens, k, lo, hi, max_drafts)
        assert NgramProposer(k, lo, hi).propose(np.array(tokens, dtype=np.int32), max_drafts) == expected
        matched += bool(expected)
    assert matched > 120  # most draws exercise a match, not only the empty answer
