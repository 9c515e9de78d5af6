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

The engine's `structured_outputs_config` (`config/structured_outputs_config.py`) says how a JSON schema compiles
(strict by default, as vLLM's default backend) and whether a constraint with a `reasoning_end` marker waits for it:
vLLM's rule, the grammar applies once the reasoning has ended. Until the text of the sequence's output holds the
marker (decoded from the tokens by llguidance's tokenizer, so a marker split over several tokens counts too),
`allowed_tokens` is None (the row samples freely) and the grammar sees no token; it sees every token after the
one that completes the marker. The chat server sets the marker under `--reasoning-parser` unless the prompt
ended the reasoning already (`entrypoints/reasoning_parsers.py`).

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

from jaxserve.config.structured_outputs_config import StructuredOutputsConfig
from jaxserve.runner.sampler import bitmask_words
from jaxserve.sampling_params import StructuredOutputsParams


class GrammarCompiler:
    """llguidance's view of the engine's tokenizer (built once, ~0.4 s), and matchers over it.

    One untouched matcher per grammar is kept (LRU) and copied for each sequence: copies share llguidance's
    lazily built lexer states, so only a grammar's first request pays for building them (measured on the
    embedded vocabulary: first mask 1.2 ms, later ones 6 us mean for a JSON schema)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], max_grammars: int = 256,
                 config: StructuredOutputsConfig | None = None):
        import llguidance.hf

        self.num_words = bitmask_words(vocab_size)
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                      eos_token=sorted(eos_token_ids))
        self._templates: OrderedDict[str, Any] = OrderedDict()
        self.max_grammars = max_grammars
        self.config = config or StructuredOutputsConfig()

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A matcher of ``params``'s grammar at its start, waiting for its `reasoning_end` marker unless the
        config's `enable_in_reasoning`."""
        grammar = params.grammar_text(strict_by_default=self.config.disable_additional_properties)
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
        reasoning_end = None if self.config.enable_in_reasoning else params.reasoning_end
        wait = None if reasoning_end is None else MarkerWait(self.tokenizer, reasoning_end)
        return GrammarMatcher(template.deep_copy(), self.num_words, wait)


class MarkerWait:
    """Whether a sequence's output text holds a marker yet, fed one token at a time (bytes, so a marker split
    over tokens, or a token split inside a character, is found)."""

    def __init__(self, tokenizer: Any, marker: str):
        self._tokenizer = tokenizer
        self._marker = marker.encode()
        self._tail = b""  # the last len(marker) - 1 bytes seen: a marker may end in the next token
        self.done = False

    def feed(self, token_id: int) -> None:
        text = self._tail + self._tokenizer.decode_bytes([token_id])
        self.done = self._marker in text
        self._tail = text[-(len(self._marker) - 1):] if len(self._marker) > 1 else b""


class GrammarMatcher:
    """One sequence's position in its grammar: the allowed next tokens, and the tokens it has taken; with a
    `MarkerWait`, the grammar starts after the token that completes the marker."""

    def __init__(self, matcher: Any, num_words: int, wait: MarkerWait | None = None):
        self._matcher = matcher
        self._bitmask = np.zeros((1, num_words), np.int32)
        self._wait = wait

    @property
    def waiting(self) -> bool:
        """The grammar waits for its marker: the next token is free."""
        return self._wait is not None and not self._wait.done

    def allowed_tokens(self) -> np.ndarray | None:
        """i32[ceil(V / 32)]: the packed bitmask of the tokens the grammar allows next (EOS where it accepts);
        None while it waits (any token)."""
        from llguidance.numpy import fill_next_token_bitmask

        if self.waiting:
            return None
        fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        return self._bitmask[0].copy()

    def consume(self, token_id: int) -> bool:
        """Advances past a sampled token; False if the grammar rejects it (the matcher then stays finished). While
        the grammar waits, the token only goes to the wait."""
        if self.waiting:
            self._wait.feed(token_id)
            return True
        return self._matcher.consume_token(token_id)

    @property
    def error(self) -> str:
        return self._matcher.get_error().split("\n", 1)[0]

    @property
    def is_finished(self) -> bool:
        """No token may follow: the grammar is complete (or took EOS), or it rejected a token."""
        return not self.waiting and self._matcher.is_stopped()


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
        """Both masks; the bad words' alone while the grammar waits for its reasoning to end."""
        grammar_allows = self.grammar.allowed_tokens()
        bad_words_allow = self.bad_words.allowed_tokens()
        return bad_words_allow if grammar_allows is None else grammar_allows & bad_words_allow

    def consume(self, token_id: int) -> bool:
        self.bad_words.consume(token_id)
        return self.grammar.consume(token_id)

    @property
    def error(self) -> str:
        return self.grammar.error

    @property
    def is_finished(self) -> bool:
        return self.grammar.is_finished
