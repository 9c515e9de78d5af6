"""Structured outputs: a JSON schema, a JSON object, a regex, a choice or a grammar, enforced on the device.

Data flow. ``SamplingParams(structured_outputs=StructuredOutputsParams(...))`` turns the constraint into a
grammar for llguidance and validates it when the params are made (an invalid schema, regex or grammar is
a ValueError naming the problem). The engine's ``GrammarCompiler`` (one per engine, built on the first
constrained request: llguidance's view of the tokenizer) gives each constrained sequence a
``GrammarMatcher``; grammars are compiled once per text (``functools.lru_cache``) when a request is added,
never in the step loop. Before every row that samples, the host fills the row's packed int32 bitmask
(``SamplingRow.allowed``: bit ``v % 32`` of word ``v // 32`` allows token ``v``) and the compiled step
masks the logits (``sampler.apply_grammar``); the sampled token is then fed to the matcher. EOS is allowed
only where the grammar accepts, and the sequence finishes when the matcher stops.

llguidance was chosen over xgrammar by measurement (``scripts/bench_grammar_engines.py``): it has no
dependencies, while xgrammar needs torch and triton at run time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import OrderedDict
from typing import Any

import numpy as np

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def bitmask_words(vocab_size: int) -> int:
    """int32 words of a packed per-row allowed-token bitmask."""
    return -(-vocab_size // 32)


@dataclasses.dataclass
class StructuredOutputsParams:
    """vLLM's names: exactly one of ``json`` (a JSON schema, dict or string), ``regex``, ``choice`` (a list of
    strings), ``grammar`` (Lark or GBNF) or ``json_object=True`` (any JSON object)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: no whitespace but single spaces after ':' and ','

    def __post_init__(self) -> None:
        given = self._given_kinds()
        if len(given) > 1:
            raise ValueError("You can only use one kind of structured outputs constraint but multiple are "
                             f"specified: {', '.join(given)}")
        if not given:
            raise ValueError("You must use one kind of structured outputs constraint but none are specified")
        if self.choice is not None and (not isinstance(self.choice, list | tuple) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured outputs choice must be a non-empty list of strings, got {self.choice!r}")
        error = validate_grammar(self.grammar_text())
        if error:
            raise ValueError(f"invalid structured outputs {given[0]}: {error}")

    def _given_kinds(self) -> list[str]:
        return [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]

    @property
    def kind(self) -> str:
        return self._given_kinds()[0]

    def grammar_text(self) -> str:
        """The llguidance grammar of the constraint (a cached function of its text)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            value = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = json.dumps(list(value))
        elif kind == "json_object":
            value = '{"type": "object"}'
        return _grammar(kind, value, self.disable_any_whitespace)


@functools.lru_cache(maxsize=256)
def _grammar(kind: str, text: str, compact_json: bool = False) -> str:
    from llguidance import LLMatcher, grammar_from

    if kind in ("json", "json_object"):
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"invalid structured outputs json: the schema is not JSON ({err})") from None
        if not isinstance(schema, dict):
            raise ValueError(f"invalid structured outputs json: a schema is a JSON object, got {text!r}")
        options = {"whitespace_flexible": False} if compact_json else None
        return LLMatcher.grammar_from_json_schema(schema, overrides=options)
    if kind == "regex":  # \d, \w, \s as ASCII classes (OpenAI's and JSON Schema's regexes), not Rust's Unicode
        from llguidance import regex_to_lark

        try:
            return LLMatcher.grammar_from_regex(regex_to_lark(text, "dws"))
        except Exception as err:  # noqa: BLE001 - llguidance's converter raises on what it cannot parse
            raise ValueError(f"invalid structured outputs regex: {err}") from None
    if kind == "choice":
        return grammar_from("choice", text)
    try:
        return grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
    except Exception as err:  # noqa: BLE001 - llguidance's converter raises whatever its parser raises
        raise ValueError(f"invalid structured outputs grammar: {err}") from None


@functools.lru_cache(maxsize=256)
def validate_grammar(grammar: str) -> str:
    """llguidance's message for a grammar it cannot compile; empty when valid."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(grammar)


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
