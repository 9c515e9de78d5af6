"""Suffix-decoding proposer: drafts from frequency-counted suffix tries (vLLM's ``method: "suffix"``, Arctic
Inference's SuffixDecoding).

Place in the data flow: after a step's sampled tokens are appended, the engine calls
``SuffixProposer.propose_for`` on the host for each decoding sequence with its id and tokens (prompt + outputs).
The drafts become extra query tokens of that sequence's row in the next mixed step, verified on the device like
the n-gram proposer's. When a sequence finishes, ``record_finished`` gives its output tokens to the global cache
(and forgets its local trie); ``release`` forgets the local trie of a sequence that was aborted or preempted.

Tries: a trie over a token list holds, for every start position, the path of its next up to ``max_tree_depth``
tokens, and each node counts the paths that pass through it. So a path of length m exists iff that m-gram occurred
(m <= max_tree_depth) and its count is the number of occurrences. Two kinds are searched:

- a *local* trie per live sequence over its own tokens, updated incrementally: each new token extends the open
  paths (the sequence's last up to max_tree_depth - 1 tokens) and starts a new one. An open path that occurred
  before is one node, counted up; one that did not ends in its own tail (below), which grows for free, so an
  append costs O(the number of recent suffixes that recur) <= O(max_tree_depth). A token list shorter than the one
  the trie saw rebuilds the trie; token lists only grow between calls, so a list of the same length or longer is
  taken to extend the one seen.
- one *global* trie over the output tokens (responses, not prompts) of the last ``max_cached_requests`` finished
  sequences; the oldest response is evicted first (FIFO), taking back the counts it added and deleting the nodes
  that fall to 0. ``max_cached_requests=0``: no global trie.

Storage: nothing per trie node is a Python object, so the garbage collector has nothing to walk in the tries (a
full collection takes the same time whatever their size; per-node objects made it walk a million of them for 20
cached 2000-token responses). A node is an int indexing ``array`` columns (count, first token, best child, child
and sibling links, label); the edges of a trie are one dict from ``(parent << 32) + token`` to the child, ints only,
which CPython does not track; the tokens a trie is over are one token array (the global one holds the cached
responses back to back and drops the evicted ones when they outnumber the rest). A node is a chain of trie nodes
of one count, its label a reference to where its tokens occur: the global trie is path-compressed (a chain ends
where its paths branch or end), at most two nodes per cached token; a local trie keeps a node per recurring
m-gram and compresses the count-1 chains, one *tail* per occurrence whose path is new.

Proposing, in each trie: a match is a suffix of the sequence's tokens (length m <= max_tree_depth - 1) that occurred
followed by a token. In the local trie the sequence's own final suffix is always a path, but that occurrence has no
continuation, so it counts in the node (the probability's denominator) without giving a child; the matches are the
open paths that occurred before. In the global trie each suffix is walked from the root, shortest first, up to the
first that is no match (the matching lengths are 1..M: an m-gram followed by x contains the (m-1)-gram followed by
x). From a match the draft follows the child of largest count (ties: the smallest token id) while the cumulative
probability, the product of child.count / node.count along the walk, is at least ``min_token_prob``; it stops at a
node without children or at ``min(num_speculative_tokens, max_drafts, floor(max_spec_factor * m))`` drafts. The
trie's depth caps match + drafts at max_tree_depth, so on copied text the longest match (m = max_tree_depth - 1)
leaves room for one draft, a shorter one for more. The product telescopes: the i-th draft's cumulative probability
is count(match + drafts[:i]) / count(match), computed as that ratio so that no rounding accumulates. A candidate's
score is the sum of its drafts' cumulative probabilities; each trie's candidate is the highest-scoring over its
matches (a later, longer match wins a tie, as in Arctic), and the higher-scoring of the local and the global
candidate is proposed, the local one on a tie. Matches that cannot score as high as the best so far are not
drafted (``SuffixProposer._best_candidate``).

vLLM delegates to Arctic Inference (``arctic_inference/suffix_decoding``: ``SuffixTree::speculate`` tries every
match length from 1 up and keeps the best-scoring draft, ``_speculate_path`` multiplies the cumulative probability
by child.count / node.count and stops below min_token_prob, its score is the sum of the cumulative probabilities,
``SuffixDecodingCache.speculate`` keeps the local candidate unless the global one scores strictly higher, and the
floor has the same 1e-6 tolerance; on a tie between match lengths ``speculate`` keeps the longer, replacing its
best on ``>=``, as here). Where this differs: Arctic's match lengths stay below the length of
its context (the last max_tree_depth tokens), so a sequence shorter than that is never matched whole, here it is;
Arctic's global tree takes a live response's tokens as they are generated (the sequence's own included), this one
when the sequence finishes; Arctic's trees are all path-compressed (O(tokens) nodes), here the global trie is but a
local trie has a node per m-gram (m <= max_tree_depth) that recurs within its sequence.

Measured (AMD EPYC, 2 cores shared with a test run, whose load moved figures by up to 1.8x, Python 3.11, depth 24,
k=5), ``propose_for`` with one new token per call as a sequence grows to 2000 tokens: median 2.5-11 us over random
tokens (vocabulary 32000 or 50) with no cached responses, 7-15 us with 20 cached 2000-token responses, 25-46 us over
a repeated 17-token pattern (every open path recurs: about max_tree_depth counts per token, and a match of every
length), 60 us when the 20 cached responses are that pattern too (a global match of every length as well), 36 us for
a copy of one of 20 cached random responses; p99 under 30 us for random tokens, 45-95 us for the pattern, 90-120 us
with it cached. The first call on a 2000-token prompt builds its local trie: 3-10 ms (12-21 ms for the pattern).
``record_finished`` of a 2000-token response: 7-14 ms random, 2-3 ms for the pattern; evicting one: 2-7 ms. A full
``gc.collect()``: 2-4 ms with or without 20 cached 2000-token responses (0.27 s with a Python object per node).
Memory per cached token (``tracemalloc``): 170-190 bytes for random tokens (1.2-1.3 nodes of about 130 bytes, most
of it the edge dict's entry and its two ints), 80-95 bytes when each response is cached twice, 6 for the pattern; a
local trie takes 105-165 bytes per token of random tokens. So vLLM's default of 10000 cached requests, at 1000
non-repeating tokens each, takes about 2 GB; repetitive responses (what suffix decoding is for) take much less.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from jaxserve.speculative.proposer import Proposer

TokenIds = Sequence[int] | np.ndarray
_FLOOR_TOLERANCE = 1e-6  # floor(max_spec_factor * m) as Arctic computes it: 0.29 * 100 is 28.999999999999996


def _require_integer(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _is_real(value: float) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


_NONE = -1  # no node: an absent child, sibling or best child (a best child of -1 is recomputed when needed)
_KEY_SHIFT = 32  # an edge's key: (parent id << 32) + token, one int per (parent, signed 32-bit token) pair


class _Trie:
    """A frequency-counted suffix trie (the module docstring's) with no Python object per node, so that the
    garbage collector has nothing to walk in it: a node is an int, its fields are entries of ``array`` columns indexed
    by it, the edges are one dict ``(parent << 32) + first token of the child's label -> child`` of ints only (which
    CPython never tracks), and the token lists the trie is over are one token array. Node 0 is the root; freed ids
    are reused (``free``).

    A node stands for a chain of trie nodes with one count: its *label*, ``tokens[label_start[n] : end]`` with end
    ``min(label_end[n], len(tokens))``, is where one occurrence of that chain's path is; ``count[n]`` is the count of
    every trie node of the chain and ``token[n]`` its first token. Its children form a doubly linked list
    (``first_child``, ``next_sibling``, ``prev_sibling``: O(1) unlinking, and the list to recompute ``best`` from);
    ``best`` is the child of the largest count (ties: the smallest token), or -1 when unknown (after an eviction
    lowered it) or childless. ``_GlobalTrie`` and ``_LocalTrie`` say how their labels are chosen."""

    __slots__ = (
        "max_depth",
        "tokens",
        "edges",
        "count",
        "token",
        "best",
        "first_child",
        "next_sibling",
        "prev_sibling",
        "label_start",
        "label_end",
        "free",
    )

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.tokens = array("i")
        self.edges: dict[int, int] = {}
        self.count = array("i", [0])
        self.token = array("i", [0])
        self.best = array("i", [_NONE])
        self.first_child = array("i", [_NONE])
        self.next_sibling = array("i", [_NONE])
        self.prev_sibling = array("i", [_NONE])
        self.label_start = array("i", [0])
        self.label_end = array("i", [0])
        self.free = array("i")

    # -- nodes ------------------------------------------------------------------------------------------------------

    def _allocate(self, token: int, count: int, label_start: int, label_end: int) -> int:
        """A node with these fields, no children and no siblings."""
        if self.free:
            node = self.free.pop()
            self.count[node] = count
            self.token[node] = token
            self.best[node] = _NONE
            self.first_child[node] = _NONE
            self.next_sibling[node] = _NONE
            self.prev_sibling[node] = _NONE
            self.label_start[node] = label_start
            self.label_end[node] = label_end
            return node
        self.count.append(count)
        self.token.append(token)
        self.best.append(_NONE)
        self.first_child.append(_NONE)
        self.next_sibling.append(_NONE)
        self.prev_sibling.append(_NONE)
        self.label_start.append(label_start)
        self.label_end.append(label_end)
        return len(self.count) - 1

    def _add_child(self, parent: int, key: int, count: int, label_start: int, label_end: int) -> int:
        """A new child of ``parent`` under edge ``key`` with this count and label."""
        child = self._allocate(self.tokens[label_start], count, label_start, label_end)
        following = self.first_child[parent]
        if following != _NONE:
            self.prev_sibling[following] = child
            self.next_sibling[child] = following
        self.first_child[parent] = child
        self.edges[key] = child
        self._counted(parent, child)
        return child

    def _split(self, parent: int, node: int, key: int, length: int, count: int, label_start: int) -> int:
        """The first ``length`` trie nodes of ``node`` (the child of ``parent`` under ``key``) get ``count``: a new
        node in ``node``'s place, labelled from ``label_start``; ``node`` keeps the rest of its chain, under the new
        one, or is freed when nothing is left."""
        new = self._allocate(self.token[node], count, label_start, label_start + length)
        previous, following = self.prev_sibling[node], self.next_sibling[node]
        self.prev_sibling[new], self.next_sibling[new] = previous, following
        if previous == _NONE:
            self.first_child[parent] = new
        else:
            self.next_sibling[previous] = new
        if following != _NONE:
            self.prev_sibling[following] = new
        if self.best[parent] == node:
            self.best[parent] = new
        self.edges[key] = new
        rest = self.label_start[node] + length
        if rest < self._label_end(node):
            token = self.tokens[rest]
            self.label_start[node] = rest
            self.token[node] = token
            self.prev_sibling[node] = self.next_sibling[node] = _NONE
            self.first_child[new] = self.best[new] = node
            self.edges[(new << _KEY_SHIFT) + token] = node
        else:
            self.free.append(node)
        self._counted(parent, new)
        return new

    def _delete(self, parent: int, node: int, key: int) -> None:
        """Unlinks ``node`` (the child of ``parent`` under edge ``key``) and frees its id; its own children's ids
        are not freed."""
        del self.edges[key]
        previous, following = self.prev_sibling[node], self.next_sibling[node]
        if previous == _NONE:
            self.first_child[parent] = following
        else:
            self.next_sibling[previous] = following
        if following != _NONE:
            self.prev_sibling[following] = previous
        if self.best[parent] == node:
            self.best[parent] = _NONE
        self.free.append(node)

    def _label_end(self, node: int) -> int:
        return min(self.label_end[node], len(self.tokens))

    def _counted(self, parent: int, child: int) -> None:
        """Keeps ``best[parent]`` right after ``child``'s count rose (only it grew: the best is it or the former
        best); an unknown best stays unknown unless ``child`` is the only child."""
        best = self.best[parent]
        if best == _NONE:
            if self.first_child[parent] == child and self.next_sibling[child] == _NONE:
                self.best[parent] = child
        elif best != child:
            count, best_count = self.count[child], self.count[best]
            if count > best_count or (count == best_count and self.token[child] < self.token[best]):
                self.best[parent] = child

    def _best_child(self, node: int) -> int:
        """``node``'s child of the largest count, the smallest token on a tie; ``node`` must have children."""
        best = self.best[node]
        if best == _NONE:
            count, token, next_sibling = self.count, self.token, self.next_sibling
            best = self.first_child[node]
            best_count, best_token = count[best], token[best]
            child = next_sibling[best]
            while child != _NONE:
                if count[child] > best_count or (count[child] == best_count and token[child] < best_token):
                    best, best_count, best_token = child, count[child], token[child]
                child = next_sibling[child]
            self.best[node] = best
        return best

    # -- searching ------------------------------------------------------------------------------------------------

    def draft(self, node: int, index: int, limit: int, min_token_prob: float) -> tuple[list[int], float]:
        """Up to ``limit`` tokens after the match ending at ``tokens[index]`` in ``node``'s label, most frequent child
        first, while the cumulative probability count(path) / count(match) is at least ``min_token_prob``; with the
        sum of those probabilities (the score)."""
        count, tokens, label_start, label_end, first_child = (
            self.count,
            self.tokens,
            self.label_start,
            self.label_end,
            self.first_child,
        )
        total = node_count = count[node]
        floor = min_token_prob * total  # the count changes (and is checked) only where the walk enters a child
        end = min(label_end[node], len(tokens))
        drafts: list[int] = []
        score = 0.0
        while len(drafts) < limit:
            index += 1
            if index >= end:
                if first_child[node] == _NONE:
                    break
                node = self._best_child(node)
                node_count, index = count[node], label_start[node]
                if node_count < floor:
                    break
                end = min(label_end[node], len(tokens))
            drafts.append(tokens[index])
            score += node_count / total
        return drafts, score


class _GlobalTrie(_Trie):
    """The trie over the cached responses, consecutive in the token array, taken in and evicted whole, oldest first.

    Path-compressed: a node is a chain whose trie nodes all have the same occurrences, split where a path branches
    off or ends (evictions do not merge chains back), so a response adds at most two nodes per token (a split and a
    leaf). Its label is the chain in the newest occurrence passing there (an
    insertion that passes a node moves the label to itself). So when the oldest response is evicted, a node labelled
    in it had all its occurrences in it and is deleted: no label ever points at evicted tokens."""

    __slots__ = ()

    def insert(self, tokens: list[int]) -> None:
        """Appends ``tokens`` to the token array and counts every start position's next up to max_depth tokens."""
        start = len(self.tokens)
        self.tokens.extend(array("i", tokens))  # converted first: a token outside int32 raises before any change
        end = len(self.tokens)
        tokens_, edges, count, label_start, label_end = (
            self.tokens,
            self.edges,
            self.count,
            self.label_start,
            self.label_end,
        )
        for occurrence in range(start, end):
            path_end = min(occurrence + self.max_depth, end)
            node, index = 0, occurrence
            while index < path_end:
                key = (node << _KEY_SHIFT) + tokens_[index]
                child = edges.get(key)
                if child is None:
                    self._add_child(node, key, 1, index, path_end)
                    break
                label = label_start[child]
                length = label_end[child] - label
                shared = min(length, path_end - index)
                if shared > 1 and tokens_[index : index + shared] != tokens_[label : label + shared]:
                    shared = 1
                    while tokens_[index + shared] == tokens_[label + shared]:
                        shared += 1
                if shared < length:  # the path leaves the chain (or ends) inside it: split it there
                    node = self._split(node, child, key, shared, count[child] + 1, index)
                    if index + shared < path_end:
                        self._add_child(
                            node, (node << _KEY_SHIFT) + tokens_[index + shared], 1, index + shared, path_end
                        )
                    break
                count[child] += 1
                label_start[child], label_end[child] = index, index + length  # the newest occurrence
                self._counted(node, child)
                node = child
                index += length

    def remove(self, start: int, end: int) -> None:
        """Takes back what ``insert`` counted for ``tokens[start:end]``, deleting the nodes whose count reaches 0
        (and the rest of their path: only that occurrence passed there). Every path ends at a node's end (where it
        ended inside a chain, ``insert`` split it), so a path passes whole nodes."""
        tokens, edges, count, best, label_start, label_end = (
            self.tokens,
            self.edges,
            self.count,
            self.best,
            self.label_start,
            self.label_end,
        )
        for occurrence in range(start, end):
            path_end = min(occurrence + self.max_depth, end)
            node, index = 0, occurrence
            while index < path_end:
                key = (node << _KEY_SHIFT) + tokens[index]
                child = edges[key]
                if best[node] == child:
                    best[node] = _NONE  # a sibling may have the largest count now
                remaining = count[child] - 1
                count[child] = remaining
                if remaining == 0:
                    self._delete(node, child, key)
                index += label_end[child] - label_start[child]
                node = child

    def continued_matches(self, tail: list[int]) -> list[tuple[int, int, int]]:
        """The matches (node, index in the token array of the match's last token in that node's label, length m) of
        the suffixes of ``tail`` that occurred followed by a token, shortest first, each walked from the root. Which
        lengths qualify is downward closed (an m-gram followed by x contains the (m-1)-gram followed by x, both
        within the depth as m + 1 <= len(tail) + 1 <= max_depth): the first length that does not ends the search."""
        edges, tokens, label_start, label_end, first_child = (
            self.edges,
            self.tokens,
            self.label_start,
            self.label_end,
            self.first_child,
        )
        path = array("i", tail)
        end = len(path)
        matches: list[tuple[int, int, int]] = []
        for m in range(1, end + 1):
            node, depth = 0, end - m
            while True:
                child = edges.get((node << _KEY_SHIFT) + path[depth])
                if child is None:
                    return matches
                start = label_start[child]
                length = min(label_end[child] - start, end - depth)
                if length > 1 and tokens[start + 1 : start + length] != path[depth + 1 : depth + length]:
                    return matches
                depth += length
                if depth == end:
                    break
                node = child
            index = start + length - 1
            if index + 1 == label_end[child] and first_child[child] == _NONE:
                return matches  # occurred, but only where its path ends
            matches.append((child, index, m))
        return matches

    def drop_tokens_before(self, position: int) -> None:
        """Forgets ``tokens[:position]``, which no label points at any more, shifting the labels."""
        del self.tokens[:position]
        for field in (self.label_start, self.label_end):
            view = np.frombuffer(field, dtype=np.intc)  # array typecode 'i'
            view -= position  # the root's and the freed nodes' labels are never read
            del view


class _LocalTrie(_Trie):
    """The trie over one growing sequence, extended a token at a time through its open paths.

    Its nodes are single trie nodes of count >= 2 (``label_end`` is ``label_start + 1``) and *tails* of count 1:
    the rest of the one occurrence that passes there, up to that occurrence's path end (``label_end`` is its start +
    max_depth, and the sequence's end caps it while it grows). When a second path enters a tail, the tail's first
    token becomes a node of count 2 in its place and the rest of the tail hangs from it. So an occurrence costs
    nodes only for its m-grams that occurred before, and one tail."""

    __slots__ = ("open_nodes",)

    def __init__(self, max_depth: int):
        super().__init__(max_depth)
        # the nodes of the sequence's suffixes of length 1, 2, ... (at most max_depth - 1) that occurred before; a
        # longer suffix occurred once: its path ends in its own tail, which grows with the sequence
        self.open_nodes: list[int] = []

    def _count(self, parent: int, key: int, child: int | None, occurrence: int, index: int) -> int:
        """One more occurrence (starting at ``tokens[occurrence]``) of ``parent``'s path followed by
        ``tokens[index]``, whose node is ``child`` (from ``key``) or None: that node, or -1 when the path is new (the
        occurrence's tail starts there). ``extend`` inlines the case of a node of count >= 2."""
        if child is None:
            self._add_child(parent, key, 1, index, occurrence + self.max_depth)
            return _NONE
        if self.count[child] == 1:
            return self._split(parent, child, key, 1, 2, index)
        self.count[child] += 1
        self._counted(parent, child)
        return child

    def extend(self, tokens: list[int]) -> None:
        """Appends ``tokens`` to the sequence: each extends the open paths and starts a new one."""
        max_open = self.max_depth - 1
        tokens_, edges, count, best, token_of = self.tokens, self.edges, self.count, self.best, self.token
        for token in tokens:
            tokens_.append(token)
            index = len(tokens_) - 1
            extended = [self._count(0, token, edges.get(token), index, index)]
            for depth, node in enumerate(self.open_nodes, start=1):
                key = (node << _KEY_SHIFT) + token
                child = edges.get(key)
                child_count = 1 if child is None else count[child] + 1
                if child_count <= 2:  # a new path or a tail
                    extended.append(self._count(node, key, child, index - depth, index))
                    continue
                # _count and _counted inlined
                count[child] = child_count
                node_best = best[node]
                if node_best != child:
                    if node_best == _NONE:
                        self._counted(node, child)
                    elif child_count > count[node_best] or (
                        child_count == count[node_best] and token_of[child] < token_of[node_best]
                    ):
                        best[node] = child
                extended.append(child)
            # a path that occurred once makes every longer one occur once: the nodes are a prefix
            if _NONE in extended:
                del extended[extended.index(_NONE) :]
            del extended[max_open:]
            self.open_nodes = extended

    def open_matches(self) -> list[tuple[int, int, int]]:
        """The matches (node, index of its token, length) of the sequence's suffixes that also occurred followed by
        a token, shortest first: the open nodes, each of which occurred before the sequence's end, so followed by a
        token that its path holds (length <= max_depth - 1)."""
        label_start = self.label_start
        return [(node, label_start[node], length) for length, node in enumerate(self.open_nodes, start=1)]


def _as_ints(tokens: TokenIds) -> list[int]:
    return tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens)


class SuffixProposer(Proposer):
    """Proposes up to ``num_speculative_tokens`` draft tokens per call from a sequence's own suffix trie and the
    global trie of recent responses (the module docstring has the semantics)."""

    def __init__(
        self,
        num_speculative_tokens: int,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ):
        _require_integer("num_speculative_tokens", num_speculative_tokens, 1)
        _require_integer("max_tree_depth", max_tree_depth, 1)
        _require_integer("max_cached_requests", max_cached_requests, 0)
        if not _is_real(max_spec_factor) or not max_spec_factor > 0:
            raise ValueError(f"max_spec_factor must be a number > 0, got {max_spec_factor!r}")
        if not _is_real(min_token_prob) or not 0 <= min_token_prob <= 1:
            raise ValueError(f"min_token_prob must be a number in [0, 1], got {min_token_prob!r}")
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.max_tree_depth = int(max_tree_depth)
        self.max_cached_requests = int(max_cached_requests)
        self.max_spec_factor = float(max_spec_factor)
        self.min_token_prob = float(min_token_prob)
        # the most drafts a match of length m can give: floor(max_spec_factor * m), and the depth's room after it
        self._draft_caps = [
            max(0, min(int(self.max_spec_factor * m + _FLOOR_TOLERANCE), self.max_tree_depth - m))
            for m in range(self.max_tree_depth)
        ]
        self._local_tries: dict[int, _LocalTrie] = {}
        self._global = _GlobalTrie(self.max_tree_depth)
        # the cached responses are consecutive in the global trie's token array: the oldest starts at
        # _cached_start, each ends at its entry of _cached_ends
        self._cached_start = 0
        self._cached_ends = array("q")

    @property
    def num_cached_requests(self) -> int:
        """How many finished sequences' responses the global trie holds."""
        return len(self._cached_ends)

    def propose_for(self, seq_id: int, token_ids: TokenIds, max_drafts: int | None = None) -> list[int]:
        """Draft tokens for sequence ``seq_id`` whose tokens (prompt + outputs, the last one the newest) are
        token_ids: its local trie takes the tokens it has not seen, then the better of the local and the global
        candidate is proposed; [] when neither trie has a continuation or max_drafts <= 0."""
        trie = self._local_tries.get(seq_id)
        if trie is None or len(token_ids) < len(trie.tokens):
            trie = self._local_tries[seq_id] = _LocalTrie(self.max_tree_depth)
        trie.extend(_as_ints(token_ids[len(trie.tokens) :]))
        return self._propose_from(trie, token_ids, max_drafts)

    def propose(self, token_ids: TokenIds, max_drafts: int | None = None) -> list[int]:
        """``propose_for`` without state: a local trie built over token_ids for this call."""
        trie = _LocalTrie(self.max_tree_depth)
        trie.extend(_as_ints(token_ids))
        return self._propose_from(trie, token_ids, max_drafts)

    def release(self, seq_id: int) -> None:
        """Forgets sequence ``seq_id``'s local trie (aborted or preempted; its id may start over)."""
        self._local_tries.pop(seq_id, None)

    def record_finished(self, seq_id: int, output_token_ids: TokenIds) -> None:
        """Sequence ``seq_id`` finished: its response (``output_token_ids``) joins the global trie, evicting the
        oldest cached one past ``max_cached_requests``, and its local trie is forgotten."""
        self.release(seq_id)
        if self.max_cached_requests == 0:
            return
        while len(self._cached_ends) >= self.max_cached_requests:
            end = self._cached_ends.pop(0)
            self._global.remove(self._cached_start, end)
            self._cached_start = end
        if self._cached_start > len(self._global.tokens) // 2:  # the evicted tokens outnumber the cached ones
            for i, end in enumerate(self._cached_ends):
                self._cached_ends[i] = end - self._cached_start
            self._global.drop_tokens_before(self._cached_start)
            self._cached_start = 0
        self._global.insert(_as_ints(output_token_ids))
        self._cached_ends.append(len(self._global.tokens))

    def _propose_from(self, trie: _LocalTrie, token_ids: TokenIds, max_drafts: int | None) -> list[int]:
        """The drafts of the higher-scoring candidate of ``trie`` and the global trie (the local one on a tie)."""
        limit = self.num_speculative_tokens if max_drafts is None else min(self.num_speculative_tokens, max_drafts)
        if limit <= 0:
            return []
        drafts, score = self._best_candidate(trie, trie.open_matches(), limit)
        if self._global.first_child[0] != _NONE:
            tail = _as_ints(token_ids[max(0, len(token_ids) - self.max_tree_depth + 1) :])
            global_drafts, global_score = self._best_candidate(
                self._global, self._global.continued_matches(tail), limit
            )
            if global_score > score:
                drafts = global_drafts
        return drafts

    def _best_candidate(self, trie: _Trie, matches: list[tuple[int, int, int]], limit: int) -> tuple[list[int], float]:
        """The highest-scoring drafts over the matches (node, index, length m; lengths 1, 2, ... in order), each at
        most floor(max_spec_factor * m) and max_tree_depth - m: a longer match drafts more surely, a shorter one
        leaves the depth more room; the longer on a tie (Arctic's rule). Two kinds of match are not drafted, as they
        cannot change the result:

        - one with the count and the cap of the match one shorter: every occurrence of the shorter one is then
          preceded by the same token, i.e. is one of the longer one, so within the cap (which the depth leaves room
          for) both have the same continuations, drafts and score;
        - one whose bound is lower than the best score: no draft's cumulative probability exceeds the first's, so
          the score is at most the first's probability summed cap times, summed as ``draft`` sums (float addition
          is monotone, so this bounds the score as computed)."""
        best_drafts: list[int] = []
        best_score = 0.0
        count, best, label_end, draft_caps = trie.count, trie.best, trie.label_end, self._draft_caps
        previous = (0, -1, -1)  # (length, count, cap) of the previous match
        for node, index, length in matches:
            cap = min(limit, draft_caps[length])
            total = count[node]
            shorter, previous = previous, (length, total, cap)
            if shorter == (length - 1, total, cap):
                continue
            # a match ending inside its node's label (global: labels lie within the tokens; a local match is one
            # token) is followed by the label's next token for certain
            if index + 1 < label_end[node]:
                probability = 1.0
            else:
                child = best[node]
                probability = count[child if child != _NONE else trie._best_child(node)] / total
            bound = 0.0
            for _ in range(cap):
                bound += probability
            if bound >= best_score:
                drafts, score = trie.draft(node, index, cap, self.min_token_prob)
                if score >= best_score:
                    best_drafts, best_score = drafts, score
        return best_drafts, best_score
