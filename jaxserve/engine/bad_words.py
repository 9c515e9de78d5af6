"""bad_words: a request's words never completed (vLLM's SamplingParams.bad_words semantics).

Place in the data flow: a `SamplingGroup` (`request_group.py`) tokenizes its request's bad words once
(`bad_words_token_ids`, as vLLM's `update_from_tokenizer`: each word as given and after a leading space). A
one-token word is banned at every step: -inf in the request's logit_bias row (the sampler's slot rows,
`runner/sampler_state.py`). A longer word's last token is banned only where the sequence's output ends with the
word's other tokens: a `BadWordsFilter` per sequence gives that step's allowed-token bitmask, applied on the
device as a grammar's is (`sampler.apply_grammar`); with structured outputs both masks hold (`BothConstraints`).
"""

from __future__ import annotations

import numpy as np

from jaxserve.runner.sampler import bitmask_words


def bad_words_token_ids(tokenizer, bad_words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of bad words: each word (leading spaces stripped) alone, and after one space when that
    makes a different first token and as many tokens (a word in the middle of a text)."""
    token_ids: list[list[int]] = []
    for word in bad_words:
        alone = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if alone:
            token_ids.append(alone)
        if spaced and (not alone or (spaced[0] != alone[0] and len(spaced) == len(alone))):
            token_ids.append(spaced)
    return token_ids


class BadWordsFilter:
    """One sequence's multi-token bad words: after each output token, the last tokens they ban next."""

    def __init__(self, words: list[list[int]], vocab_size: int):
        self.words = [tuple(word) for word in words if len(word) > 1]
        self.num_words = bitmask_words(vocab_size)
        self.output: list[int] = []

    def banned_tokens(self) -> set[int]:
        """vLLM's rule: a word's last token, where the output ends with the word's other tokens."""
        banned = set()
        for word in self.words:
            prefix = word[:-1]
            if len(prefix) <= len(self.output) and tuple(self.output[len(self.output) - len(prefix):]) == prefix:
                banned.add(word[-1])
        return banned

    def allowed_tokens(self) -> np.ndarray:
        """i32[ceil(V / 32)]: the packed bitmask of every token but the banned ones."""
        mask = np.full(self.num_words, -1, np.int32).view(np.uint32)
        for token in self.banned_tokens():
            mask[token // 32] &= ~np.uint32(1 << (token % 32))
        return mask.view(np.int32)

    def consume(self, token_id: int) -> bool:
        self.output.append(token_id)
        return True

    error = ""
    is_finished = False  # bad words never end a sequence


class BothConstraints:
    """A grammar and a bad-words filter on one sequence: the tokens both allow; the grammar decides the end."""

    def __init__(self, grammar, bad_words: BadWordsFilter):
        self.grammar, self.bad_words = grammar, bad_words

    def allowed_tokens(self) -> np.ndarray:
        return self.grammar.allowed_tokens() & self.bad_words.allowed_tokens()

    def consume(self, token_id: int) -> bool:
        self.bad_words.consume(token_id)
        return self.grammar.consume(token_id)

    @property
    def error(self) -> str:
        return self.grammar.error

    @property
    def is_finished(self) -> bool:
        return self.grammar.is_finished
