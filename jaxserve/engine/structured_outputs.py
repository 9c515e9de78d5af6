"""Structured outputs: a JSON schema, a JSON object, a regex, a choice or a grammar, enforced on the device.

Data flow. ``SamplingParams(structured_outputs=StructuredOutputsParams(...))`` (``sampling_params.py``)
turns the constraint into a grammar for llguidance and validates it when the params are made (an invalid
schema, regex or grammar is a ValueError naming the problem). The engine's ``GrammarCompiler`` (one per
engine, built on the first constrained request: llguidance's view of the tokenizer) gives each
constrained sequence a ``GrammarMatcher``; grammars are compiled once per text (``functools.lru_cache``)
when a request is added, never in the step loop. Before every row that samples, the host fills the row's
packed int32 bitmask (``SamplingRow.allowed``: bit ``v % 32`` of word ``v // 32`` allows token ``v``) and
the compiled step masks the logits (``sampler.apply_grammar``); the sampled token is then fed to the
matcher. EOS is allowed only where the grammar accepts, and the sequence finishes when the matcher stops.

llguidance was chosen over xgrammar by measurement (``scripts/bench_grammar_engines.py``): it has no
dependencies, while xgrammar needs torch and triton at run time.

Bad words (vLLM's ``SamplingParams.bad_words``) take the same path. A ``SamplingGroup`` tokenizes its
request's words once (``bad_words_token_ids``, as vLLM's ``update_from_tokenizer``: each word as given and
after a leading space). A one-token word is banned at every step: -inf in the request's logit_bias row (the
sampler's slot rows). A longer word's last token is banned only where the sequence's output ends with the
word's other tokens: a ``BadWordsFilter`` per sequence gives that step's allowed-token bitmask, as a matcher
does; with structured outputs both masks hold (``BothConstraints``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from jaxserve.runner.sampler import bitmask_words
from jaxserve.sampling_params import StructuredOutputsParams


class GrammarCompiler:
    """llguidance's view of the engine's tokenizer (built once, ~0.4 s), and matchers over it.

    One untouched matcher per grammar is kept (LRU) and copied for each sequence: copies share llguidance's
    lazily built lexer states, so only a grammar's first request pays for building them (measured on the
    embedded vocabulary: first mask 1.2 ms, later ones 6 us mean for a JSON schema)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], max_grammars: int = 256):
        import llguidance.hf

        self.num_words = bitmask_words(vocab_size)
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                      eos_token=sorted(eos_token_ids))
        self._templates: OrderedDict[str, Any] = OrderedDict()
        self.max_grammars = max_grammars

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        grammar = params.grammar_text()
        template = self._templates.get(grammar)
        if template is None:
            from llguidance import LLMatcher

            template = LLMatcher(self.tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"invalid structured outputs {params.kind}: {template.get_error()}")
            self._templates[grammar] = template
            if len(self._templates) > self.max_grammars:
                self._templates.popitem(last=False)
        self._templates.move_to_end(grammar)
        return GrammarMatcher(template.deep_copy(), self.num_words)


class GrammarMatcher:
    """One sequence's position in its grammar: the allowed next tokens, and the tokens it has taken."""

    def __init__(self, matcher: Any, num_words: int):
        self._matcher = matcher
        self._bitmask = np.zeros((1, num_words), np.int32)

    def allowed_tokens(self) -> np.ndarray:
        """i32[ceil(V / 32)]: the packed bitmask of the tokens the grammar allows next (EOS where it accepts)."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        return self._bitmask[0].copy()

    def consume(self, token_id: int) -> bool:
        """Advances past a sampled token; False if the grammar rejects it (the matcher then stays finished)."""
        return self._matcher.consume_token(token_id)

    @property
    def error(self) -> str:
        return self._matcher.get_error().split("\n", 1)[0]

    @property
    def is_finished(self) -> bool:
        """No token may follow: the grammar is complete (or took EOS), or it rejected a token."""
        return self._matcher.is_stopped()


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
