"""The suffix-decoding proposer: hand-made sequences and cached responses with exact drafts, constructor
validation, and randomized comparisons of the incremental local trie with a rebuilt one and of both with a
brute-force n-gram counting reference of the same semantics; the tries hold nothing the garbage collector walks."""

import gc
import random

import numpy as np
import pytest

from jaxserve.speculative.suffix import SuffixProposer


def propose(tokens, k=5, max_drafts=None, **options):
    return SuffixProposer(k, **options).propose_for(0, tokens, max_drafts)


def with_responses(responses, k=8, **options):
    proposer = SuffixProposer(k, **options)
    for seq_id, response in enumerate(responses, start=100):
        proposer.record_finished(seq_id, response)
    return proposer


def test_repeated_pattern_drafts_its_continuation_from_the_local_trie():
    # [1, 2, 3] occurred at 0..2 followed by 4; the longer suffixes only occur at the end
    tokens = [1, 2, 3, 4, 5, 1, 2, 3]
    assert propose(tokens, k=5) == [4, 5, 1]  # floor(1.0 * 3) drafts
    assert propose(tokens, k=2) == [4, 5]


def test_own_final_suffix_is_no_match():
    assert propose([1, 2, 3]) == []
    assert propose([7]) == []
    assert propose([]) == []
    assert propose([5, 5]) == [5]  # [5] at 0 is followed by 5


def test_finished_response_drafts_for_a_new_request_through_the_global_trie():
    proposer = with_responses([[10, 11, 12, 13, 14, 15]], k=4)
    assert proposer.num_cached_requests == 1
    assert proposer.propose_for(1, [5, 10, 11, 12]) == [13, 14, 15]  # match [10, 11, 12], 3 drafts
    assert proposer.propose_for(2, [10, 11]) == [12, 13]
    assert proposer.propose_for(3, [5, 6]) == []
    assert proposer.propose([5, 10, 11, 12]) == [13, 14, 15]


def test_prompts_do_not_reach_the_global_trie():
    proposer = SuffixProposer(4)
    proposer.propose_for(1, [10, 11, 12, 13, 14, 15, 16])  # a prompt the local trie saw
    proposer.record_finished(1, [20])
    assert proposer.propose_for(2, [10, 11, 12]) == []


def test_no_global_cache():
    proposer = with_responses([[10, 11, 12, 13, 14, 15]], k=4, max_cached_requests=0)
    assert proposer.num_cached_requests == 0
    assert proposer.propose_for(1, [5, 10, 11, 12]) == []


def test_most_frequent_continuation_and_min_token_prob_cut():
    # [1, 2] occurs 10 times; the cumulative probabilities: 3 -> 9/10, 4 -> 9/10, 5 -> 8/10, 6 -> 5/10 (7: 3/10)
    responses = [[1, 2, 3, 4, 5, 6]] * 5 + [[1, 2, 3, 4, 5, 7]] * 3 + [[1, 2, 3, 4, 8], [1, 2, 9]]
    query = [30, 1, 2]

    def drafts(min_token_prob):
        return with_responses(responses, max_spec_factor=3.0, min_token_prob=min_token_prob).propose_for(0, query)

    assert drafts(0.1) == [3, 4, 5, 6]  # [1, 2, 3, 4, 5, 6] has no continuation
    assert drafts(0.5) == [3, 4, 5, 6]  # 5/10 is not below 0.5
    assert drafts(0.51) == [3, 4, 5]
    assert drafts(0.8) == [3, 4, 5]
    assert drafts(0.81) == [3, 4]
    assert drafts(0.95) == []
    assert drafts(0.0) == [3, 4, 5, 6]


def test_equal_counts_take_the_smallest_token():
    responses = [[1, 2, 7], [1, 2, 7], [1, 2, 6], [1, 2, 6]]
    assert with_responses(responses).propose_for(0, [1, 2]) == [6]


def test_max_spec_factor_limits_drafts_to_floor_of_factor_times_match_length():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]  # match [1, 2], m = 2
    assert propose(tokens, k=10) == [3, 4]
    assert propose(tokens, k=10, max_spec_factor=2.0) == [3, 4, 5, 6]
    assert propose(tokens, k=10, max_spec_factor=1.5) == [3, 4, 5]
    assert propose(tokens, k=10, max_spec_factor=0.5) == [3]
    assert propose(tokens, k=10, max_spec_factor=0.4) == []


def test_num_speculative_tokens_and_max_drafts_cap():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose(tokens, k=3, max_spec_factor=2.0) == [3, 4, 5]
    assert propose(tokens, k=3, max_drafts=1, max_spec_factor=2.0) == [3]
    assert propose(tokens, k=3, max_drafts=10, max_spec_factor=2.0) == [3, 4, 5]
    assert propose(tokens, k=3, max_drafts=0) == []
    assert propose(tokens, k=3, max_drafts=-1) == []


def test_max_tree_depth_caps_match_and_draft_length():
    # [3], [2, 3] and [1, 2, 3] occurred twice (at 0..2 and at the end), each draft 1/2: m drafts score m / 2
    # (factor 1), unless the depth (match + drafts <= max_tree_depth) cuts them short
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    assert propose(tokens) == [4, 5, 6]  # m = 3, score 1.5
    # m = 3 reaches [1, 2, 3, 4, 5], 2 drafts: score 1.0, as m = 2's; the shorter on a tie (the same drafts)
    assert propose(tokens, max_tree_depth=5) == [4, 5]
    # m = 3 leaves room for 1 draft (score 0.5), m = 2 for 2 (1.0): the shorter match drafts more
    assert propose(tokens, max_tree_depth=4) == [4, 5]
    assert propose(tokens, max_tree_depth=3) == [4]  # m <= 2; m = 1 and m = 2 both draft [4] (score 0.5)
    assert propose(tokens, max_tree_depth=2) == [4]  # match [3]
    assert propose(tokens, max_tree_depth=1) == []


def test_the_longest_match_of_the_highest_score_wins():
    # [2] occurred 6 times, 3 times followed by 3: m = 1 drafts [3] (cap 1) with score 3/6 = 0.5.
    # [1, 2] occurred 4 times, followed by 3, 5, 6, 7 once each: m = 2 drafts [3, 4] (cap 2) at 1/4 each, score 0.5.
    # A tie: the longer match's drafts are proposed (Arctic's rule)
    responses = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 6], [1, 2, 7], [2, 3], [2, 3]]
    assert with_responses(responses).propose_for(0, [1, 2]) == [3, 4]
    # one more [2, 3]: m = 1 scores 4/7 > 0.5; one more [1, 2, 3, 4]: m = 2 scores 2/5 + 2/5 > m = 1's 4/7
    assert with_responses([*responses, [2, 3]]).propose_for(0, [1, 2]) == [3]
    assert with_responses([*responses, [1, 2, 3, 4]]).propose_for(0, [1, 2]) == [3, 4]


def test_copied_text_drafts_up_to_k_tokens_where_the_longest_match_leaves_the_depth_no_room():
    # 40 distinct tokens, then a copy of the first 30: from the 4th copied token on, every suffix of length
    # 4 <= m <= 23 occurred once before, followed by the rest of the text (probability 1/2 per draft in the local
    # trie, which counts the suffix's own occurrence). With depth 24, m <= 20 leaves room for 4 drafts (score 2.0);
    # the longest match (m = 23 once 23 tokens are copied) would leave room for 1.
    text = random.Random(0).sample(range(1000), 40)
    tokens = text + text[:30]
    proposer = SuffixProposer(4, max_tree_depth=24)
    for n in range(1, len(tokens) + 1):
        drafts = proposer.propose_for(0, tokens[:n])
        if n >= 44:
            assert drafts == text[n - 40 : n - 36], n
    assert reference_drafts([tokens], tokens[-23:], 4, 24, 0.1) == (text[30:31], 0.5)  # the longest match


def test_higher_score_wins_and_a_tie_goes_to_the_local_trie():
    query = [1, 2, 9, 1, 2]  # local: match [1, 2], drafts [9, 1] at 1/2 each, score 1.0
    assert propose(query) == [9, 1]
    assert with_responses([[1, 2, 3, 4]]).propose_for(0, query) == [3, 4]  # score 2.0
    assert with_responses([[1, 2, 3, 4], [1, 2, 5, 6]]).propose_for(0, query) == [9, 1]  # score 1.0
    assert with_responses([[1, 2, 3], [1, 2, 4]]).propose_for(0, query) == [9, 1]  # score 0.5


def test_fifo_eviction_takes_back_an_evicted_responses_counts():
    proposer = with_responses([[1, 2, 3, 4], [1, 2, 5], [20, 21, 22]], max_cached_requests=3)
    assert proposer.propose_for(0, [1, 2]) == [3, 4]  # 3 and 5 once each: the smaller id
    proposer.record_finished(1, [7, 8])  # evicts [1, 2, 3, 4]
    assert proposer.num_cached_requests == 3
    assert proposer.propose_for(2, [1, 2]) == [5]
    assert proposer.propose_for(3, [3]) == []
    assert proposer.propose_for(4, [20, 21]) == [22]
    proposer.record_finished(5, [9])  # evicts [1, 2, 5]
    assert proposer.propose_for(6, [1, 2]) == []
    assert proposer.propose_for(7, [20, 21]) == [22]
    assert proposer.propose_for(8, [7]) == [8]


def test_eviction_recomputes_the_most_frequent_continuation():
    proposer = with_responses([[1, 2, 3]] * 3 + [[1, 2, 5]] * 2, max_cached_requests=5)
    assert proposer.propose_for(0, [1, 2]) == [3]  # 3 three times, 5 twice
    proposer.record_finished(1, [8])  # evicts a [1, 2, 3]: twice each, the smaller id
    assert proposer.propose_for(2, [1, 2]) == [3]
    proposer.record_finished(3, [8])  # evicts another: 3 once, 5 twice
    assert proposer.propose_for(4, [1, 2]) == [5]


def test_record_finished_and_release_drop_the_local_trie():
    proposer = SuffixProposer(5)
    assert proposer.propose_for(1, [1, 2, 3, 1, 2]) == [3, 1]
    # the same id with a longer list extends the trie it has: [1, 2, 3, 1, 2, 1] drafts 2 after [1]
    assert proposer.propose_for(1, [1, 2, 3, 1, 2, 1]) == [2]
    proposer.release(1)
    assert proposer.propose_for(1, [4, 4, 4, 4, 4, 1]) == []  # a new trie: [1] only at the end
    proposer.propose_for(2, [1, 2, 3, 1, 2])
    proposer.record_finished(2, [])
    assert proposer.propose_for(2, [4, 4, 4, 4, 4, 1]) == []
    proposer.release(99)  # unknown ids are fine


def test_a_shorter_list_rebuilds_the_local_trie():
    proposer = SuffixProposer(5)
    assert proposer.propose_for(1, [1, 2, 3, 1, 2]) == [3, 1]
    assert proposer.propose_for(1, [5, 6, 5]) == [6]


def test_propose_keeps_no_state():
    proposer = SuffixProposer(5)
    assert proposer.propose([1, 2, 3, 1, 2]) == [3, 1]
    assert proposer.propose([9, 1, 2]) == []


def test_ndarray_input_gives_python_ints():
    proposer = with_responses([np.array([4, 5, 6, 7])])
    tokens = np.array([1, 2, 3, 1, 2, 4, 5], dtype=np.int32)
    drafts = proposer.propose_for(0, tokens)
    assert drafts == [6, 7] and all(type(token) is int for token in drafts)
    assert proposer.propose_for(0, np.append(tokens, 6)) == [7]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer >= 1, got 0"),
        ({"num_speculative_tokens": 2.0}, r"num_speculative_tokens must be an integer >= 1, got 2\.0"),
        ({"num_speculative_tokens": True}, r"num_speculative_tokens must be an integer >= 1, got True"),
        ({"max_tree_depth": 0}, r"max_tree_depth must be an integer >= 1, got 0"),
        ({"max_cached_requests": -1}, r"max_cached_requests must be an integer >= 0, got -1"),
        ({"max_cached_requests": None}, r"max_cached_requests must be an integer >= 0, got None"),
        ({"max_spec_factor": 0}, r"max_spec_factor must be a number > 0, got 0"),
        ({"max_spec_factor": float("nan")}, r"max_spec_factor must be a number > 0, got nan"),
        ({"max_spec_factor": "1"}, r"max_spec_factor must be a number > 0, got '1'"),
        ({"min_token_prob": -0.1}, r"min_token_prob must be a number in \[0, 1\], got -0\.1"),
        ({"min_token_prob": 1.5}, r"min_token_prob must be a number in \[0, 1\], got 1\.5"),
    ],
)
def test_constructor_errors(kwargs, message):
    kwargs = {"num_speculative_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=f"^{message}$"):
        SuffixProposer(**kwargs)


def test_constructor_accepts_the_bounds():
    proposer = SuffixProposer(
        np.int64(1), max_tree_depth=1, max_cached_requests=0, max_spec_factor=0.01, min_token_prob=1
    )
    assert (proposer.num_speculative_tokens, proposer.max_tree_depth, proposer.min_token_prob) == (1, 1, 1.0)
    assert SuffixProposer(1, min_token_prob=0).min_token_prob == 0.0


def gc_walked_objects(root):
    """The GC-tracked objects reachable from ``root`` (not following classes or modules): what a collection walks."""
    seen, stack = set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or not gc.is_tracked(obj) or isinstance(obj, type):
            continue
        seen.add(id(obj))
        stack.extend(gc.get_referents(obj))
    return len(seen)


def test_the_tries_hold_no_objects_for_the_garbage_collector_to_walk():
    rng = random.Random(0)
    proposer = SuffixProposer(5, max_cached_requests=50)
    proposer.record_finished(0, [1, 2, 3])
    proposer.propose_for(1, [1, 2])
    baseline = gc_walked_objects(proposer)
    for seq_id in range(100, 160):  # evicting from the 51st on
        proposer.record_finished(seq_id, [rng.randrange(40) for _ in range(300)])
    proposer.propose_for(1, [rng.randrange(40) for _ in range(2000)])  # rebuilds the local trie: shorter list seen
    proposer.propose_for(1, [rng.randrange(40) for _ in range(3000)])
    assert proposer.num_cached_requests == 50
    assert gc_walked_objects(proposer) == baseline


# -- a brute-force reference: n-gram counts over the token lists themselves ---------------------------------------


def count(lists, path):
    n = len(path)
    return sum(tokens[i : i + n] == path for tokens in lists for i in range(len(tokens) - n + 1))


def continuations(lists, path, depth):
    """Token -> occurrences of path + [token], for paths the depth holds."""
    if len(path) + 1 > depth:
        return {}
    found = {
        tokens[i + len(path)]
        for tokens in lists
        for i in range(len(tokens) - len(path))
        if tokens[i : i + len(path)] == path
    }
    return {token: count(lists, [*path, token]) for token in found}


def reference_drafts(lists, match, limit, depth, min_prob):
    """The drafts after ``match`` (most frequent continuation first, the smallest token on a tie) and their score."""
    total = count(lists, match)
    drafts, score, path = [], 0.0, list(match)
    while len(drafts) < limit:
        options = continuations(lists, path, depth)
        if not options:
            break
        token = min(options, key=lambda t: (-options[t], t))
        if options[token] < min_prob * total:
            break
        drafts.append(token)
        score += options[token] / total
        path.append(token)
    return drafts, score


def reference_candidate(lists, tokens, limit, depth, factor, min_prob):
    """Every suffix length m <= depth - 1 whose suffix occurred followed by a token, shortest first, drafts at most
    floor(factor * m); the first of the highest score is kept (a later one must score strictly higher)."""
    best = [], 0.0
    for m in range(1, min(len(tokens), depth - 1) + 1):
        match = tokens[len(tokens) - m :]
        if continuations(lists, match, depth):  # every length is tried: no assumption that they are downward closed
            candidate = reference_drafts(lists, match, min(limit, int(factor * m + 1e-6)), depth, min_prob)
            if candidate[1] >= best[1]:
                best = candidate
    return best


def reference(tokens, responses, k, depth, factor=1.0, min_prob=0.1):
    local = reference_candidate([tokens], tokens, k, depth, factor, min_prob)
    cached = reference_candidate(responses, tokens, k, depth, factor, min_prob)
    return cached[0] if cached[1] > local[1] else local[0]


@pytest.mark.parametrize("seed", range(6))
def test_incremental_local_trie_matches_a_rebuilt_one_and_the_reference(seed):
    rng = random.Random(seed)
    depth = rng.choice([2, 3, 5, 24])
    factor, min_prob = rng.choice([(1.0, 0.1), (2.0, 0.3), (0.5, 0.0)])
    k = 4
    options = dict(max_tree_depth=depth, max_spec_factor=factor, min_token_prob=min_prob)
    tokens = [rng.randrange(3) for _ in range(30)]
    incremental = SuffixProposer(k, **options)
    for n in range(1, len(tokens) + 1):
        expected = reference(tokens[:n], [], k, depth, factor, min_prob)
        assert incremental.propose_for(7, tokens[:n]) == expected, (seed, n)
        assert SuffixProposer(k, **options).propose_for(7, tokens[:n]) == expected, (seed, n)


@pytest.mark.parametrize("seed", range(6))
def test_global_trie_with_eviction_matches_the_reference(seed):
    rng = random.Random(100 + seed)
    depth = rng.choice([2, 3, 5, 24])
    factor, min_prob = rng.choice([(1.0, 0.1), (2.0, 0.3), (0.5, 0.0)])
    k, max_cached = 4, 3
    proposer = SuffixProposer(
        k, max_tree_depth=depth, max_cached_requests=max_cached, max_spec_factor=factor, min_token_prob=min_prob
    )
    finished = []
    for seq_id in range(8):
        response = [rng.randrange(4) for _ in range(rng.randrange(12))]
        proposer.record_finished(seq_id, response)
        finished.append(response)
        cached = finished[-max_cached:]
        assert proposer.num_cached_requests == len(cached)
        for _ in range(4):
            query = [rng.randrange(4) for _ in range(rng.randrange(1, 10))]
            expected = reference(query, cached, k, depth, factor, min_prob)
            assert proposer.propose([*query]) == expected, (seed, seq_id, query)


def mutated_repeats(rng, length, vocab):
    """A repeated pattern with a few tokens changed: long paths that recur, then diverge, then recur."""
    pattern = [rng.randrange(vocab) for _ in range(rng.randint(2, 6))]
    tokens = (pattern * length)[:length]
    for _ in range(rng.randrange(4)):
        tokens[rng.randrange(length)] = rng.randrange(vocab)
    return tokens


@pytest.mark.parametrize("seed", range(4))
def test_repeated_text_in_the_local_trie_matches_the_reference(seed):
    rng = random.Random(200 + seed)
    depth = rng.choice([4, 7, 24])
    tokens = mutated_repeats(rng, 50, rng.choice([3, 50]))
    incremental = SuffixProposer(6, max_tree_depth=depth, max_spec_factor=2.0)
    for n in range(1, len(tokens) + 1):
        expected = reference(tokens[:n], [], 6, depth, factor=2.0)
        assert incremental.propose_for(3, np.array(tokens[:n])) == expected, (seed, n)


@pytest.mark.parametrize("seed", range(6))
def test_many_evictions_of_repeated_and_random_responses_match_the_reference(seed):
    rng = random.Random(300 + seed)
    depth = rng.choice([3, 6, 24])
    max_cached = rng.choice([2, 3, 5])
    min_prob = rng.choice([0.0, 0.2])
    proposer = SuffixProposer(5, max_tree_depth=depth, max_cached_requests=max_cached, min_token_prob=min_prob)
    finished = []
    for seq_id in range(60):
        kind = rng.random()
        if kind < 0.4:
            response = mutated_repeats(rng, rng.randint(1, 30), 4)
        else:
            response = [rng.randrange(4) for _ in range(rng.randrange(20 if kind < 0.9 else 1))]
        proposer.record_finished(seq_id, response)
        finished.append(response)
        cached = finished[-max_cached:]
        for _ in range(3):
            source = rng.choice(cached) or [rng.randrange(4)]
            start = rng.randrange(len(source))
            query = source[start : start + rng.randrange(1, 10)]  # a window of a cached response: deep matches
            query = [rng.randrange(4), *query] if rng.random() < 0.5 else query
            expected = reference(query, cached, 5, depth, min_prob=min_prob)
            assert proposer.propose(query) == expected, (seed, seq_id, query)
