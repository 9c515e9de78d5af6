"""SamplingParams, BeamSearchParams and StructuredOutputsParams: how one request is decoded, with vLLM's names,
defaults and checks.

The engine turns SamplingParams into per-row arrays for the on-device sampler (`runner/sampler.py`) and
into host-side stop checks (`engine/detokenizer.py`, `engine/request_group.py`); a new value never
recompiles anything. A StructuredOutputsParams constraint becomes an llguidance grammar here, validated
when the params are made; the engine's matchers enforce it (`engine/structured_outputs.py`).
BeamSearchParams drive `LLM.beam_search` (`engine/beam_search.py`). Every invalid value raises a
ValueError naming the field, with vLLM's wording.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from enum import IntEnum

from jaxserve.json_schemas import strict_schema
from jaxserve.logger import init_logger

logger = init_logger("jaxserve.sampling_params")

SAMPLING_EPS = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MIN_TEMPERATURE = 1e-2  # vLLM raises smaller positive temperatures to this (they overflow in softmax)
MAX_TEMPERATURE = 2.0
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for one logit bias value


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # every output holds only what is new since the previous one
    FINAL_ONLY = 2  # only the finished output is returned


_KINDS = ("json", "regex", "choice", "grammar", "json_object")


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
    # JSON schemas: True: no properties beyond those named unless additionalProperties says so (vLLM's default
    # backend); False: JSON Schema's reading; None: the engine's structured_outputs_config (default True)
    disable_additional_properties: bool | None = None
    # the constraint waits until the output holds this text (a reasoning parser's end marker, e.g. "</think>"): the
    # tokens up to and including the one that completes it are free; None: it applies from the first token
    reasoning_end: str | None = None

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
        if self.disable_additional_properties not in (None, True, False):
            raise ValueError("structured outputs disable_additional_properties must be true or false, got "
                             f"{self.disable_additional_properties!r}")
        if self.reasoning_end is not None and (not isinstance(self.reasoning_end, str) or not self.reasoning_end):
            raise ValueError(f"structured outputs reasoning_end must be a non-empty string, got {self.reasoning_end!r}")
        error = validate_grammar(self.grammar_text())
        if error:
            raise ValueError(f"invalid structured outputs {given[0]}: {error}")

    def _given_kinds(self) -> list[str]:
        return [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]

    @property
    def kind(self) -> str:
        return self._given_kinds()[0]

    def grammar_text(self, strict_by_default: bool = True) -> str:
        """The llguidance grammar of the constraint (a cached function of its text). A JSON schema is strict
        (`jaxserve.json_schemas.strict_schema`) when `disable_additional_properties` says so, or, where it is
        None, when ``strict_by_default`` (the engine's `structured_outputs_config`) does."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            value = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = json.dumps(list(value))
        elif kind == "json_object":
            value = '{"type": "object"}'
        strict = strict_by_default if self.disable_additional_properties is None else self.disable_additional_properties
        return _grammar(kind, value, self.disable_any_whitespace, strict and kind == "json")


@functools.lru_cache(maxsize=256)
def _grammar(kind: str, text: str, compact_json: bool = False, strict: bool = False) -> str:
    from llguidance import LLMatcher, grammar_from

    if kind in ("json", "json_object"):
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"invalid structured outputs json: the schema is not JSON ({err})") from None
        if not isinstance(schema, dict):
            raise ValueError(f"invalid structured outputs json: a schema is a JSON object, got {text!r}")
        if strict:
            schema = strict_schema(schema)
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


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # sequences generated; the n with the highest cumulative logprob are returned
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # a JSON schema, regex, choice or grammar
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len)
    allowed_token_ids: list[int] | None = None  # sample only these tokens
    bad_words: list[str] | None = None  # never complete one of these words' token sequences

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        if self.seed == -1:
            self.seed = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        if self.bad_words is not None:
            self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
        if isinstance(self.structured_outputs, dict):  # JSON bodies (the server's /generate)
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as err:
                raise ValueError(f"invalid structured_outputs: {err}") from None
        self._validate()
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s; raised to %s", self.temperature, MIN_TEMPERATURE,
                           MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        if self.is_greedy:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            _check(self.n == 1, f"n must be 1 when using greedy sampling, got {self.n}.")
            _check(self.best_of == 1, f"best_of must be 1 when using greedy sampling, got {self.best_of}.")

    def _validate(self) -> None:
        _check_count(self.n, "n")
        _check_count(self.best_of, "best_of")
        _check(
            self.best_of >= self.n,
            f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}.",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}.")
        rep = self.repetition_penalty
        _check(_is_number(rep) and math.isfinite(rep), f"repetition_penalty must be a finite number, got {rep}.")
        _check(rep > 0.0, f"repetition_penalty must be greater than zero, got {rep}.")
        temp = self.temperature
        _check(_is_number(temp) and math.isfinite(temp), f"temperature must be a finite number, got {temp}.")
        _check(temp >= 0.0, f"temperature must be non-negative, got {temp}.")
        _check(temp <= MAX_TEMPERATURE, f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temp}.")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}.")
        _check(_is_int(self.top_k), f"top_k must be an integer, got {type(self.top_k).__name__}.")
        _check(self.top_k >= -1, f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.")
        _check(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}.")
        _check(self.seed is None or INT64_MIN <= self.seed <= INT64_MAX,  # vLLM's bound (torch.long)
               f"seed must be in [{INT64_MIN}, {INT64_MAX}], got {self.seed}.")
        self._validate_lengths()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and value >= 0), f"{name} must be non-negative, got {value}.")
        _check(all(_is_int(t) for t in self.stop_token_ids),
               f"stop_token_ids must contain only integers, got {self.stop_token_ids}.")
        _check(all(isinstance(s, str) for s in self.stop), f"stop must be strings, got {self.stop}.")
        _check(all(self.stop), "stop cannot contain an empty string.")
        _check(isinstance(self.output_kind, RequestOutputKind),
               f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}.")
        self._validate_token_filters()

    def _validate_token_filters(self) -> None:
        """truncate_prompt_tokens, allowed_token_ids and bad_words (vLLM's messages; their vocabulary checks are
        the engine's, `engine/request_checks.py`)."""
        k = self.truncate_prompt_tokens
        _check(k is None or (_is_int(k) and (k >= 1 or k == -1)),
               f"truncate_prompt_tokens must be an integer >= 1 or -1, got {k}")
        allowed = self.allowed_token_ids
        _check(allowed is None or len(allowed) > 0, "allowed_token_ids is not None and empty!")
        _check(allowed is None or all(_is_int(t) for t in allowed),
               f"allowed_token_ids must contain only integers, got {allowed}.")
        _check(self.bad_words is None or all(isinstance(w, str) for w in self.bad_words),
               f"bad_words must be strings, got {self.bad_words}.")

    def _validate_lengths(self) -> None:
        max_tokens, min_tokens = self.max_tokens, self.min_tokens
        _check(max_tokens is None or (_is_int(max_tokens) and max_tokens >= 1),
               f"max_tokens must be at least 1, got {max_tokens}.")
        _check(_is_int(min_tokens) and min_tokens >= 0,
               f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
        _check(max_tokens is None or min_tokens <= max_tokens,
               f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def output_text_buffer_length(self) -> int:
        """Characters held back from streamed text: they may still turn out to start a stop string."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1


@dataclasses.dataclass
class BeamSearchParams:
    """`LLM.beam_search` parameters (vLLM's). Each step expands every beam by its 2 * beam_width most
    likely tokens and keeps the beam_width best; the result is sorted by
    cum_logprob / len(tokens) ** length_penalty (the prompt counts in the length, a final EOS does not).

    Beyond vLLM's (which the server drops there): ``stop`` strings and ``stop_token_ids`` complete a beam as EOS
    does; ``logprobs`` top entries per token at least (2 * beam_width are always there); ``seed`` fixes the
    draws of a beam search with temperature > 0."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))
        if self.seed == -1:
            self.seed = None
        _check_count(self.beam_width, "beam_width")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               f"max_tokens must be at least 1, got {self.max_tokens}.")
        temp = self.temperature
        _check(_is_number(temp) and math.isfinite(temp) and 0.0 <= temp <= MAX_TEMPERATURE,
               f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temp}.")
        _check(_is_number(self.length_penalty) and math.isfinite(self.length_penalty),
               f"length_penalty must be a finite number, got {self.length_penalty}.")
        _check(all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop}.")
        _check(all(_is_int(t) for t in self.stop_token_ids),
               f"stop_token_ids must contain only integers, got {self.stop_token_ids}.")
        _check(self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
               f"logprobs must be non-negative, got {self.logprobs}.")
        _check(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}.")


def _normalize_logit_bias(logit_bias) -> dict[int, float] | None:
    """Token ids as ints (JSON sends strings), biases clamped to [-100, 100] as OpenAI does."""
    if logit_bias is None:
        return None
    _check(isinstance(logit_bias, dict), f"logit_bias must be a dict of token id to bias, got {logit_bias!r}.")
    normalized = {}
    for token, bias in logit_bias.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids (integers), got {token!r}.") from None
        _check(_is_number(bias) and math.isfinite(bias), f"logit_bias values must be finite numbers, got {bias!r}.")
        normalized[token_id] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(bias)))
    return normalized


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_count(value, name: str) -> None:
    _check(_is_int(value), f"{name} must be an int, but is of type {type(value).__name__}.")
    _check(value >= 1, f"{name} must be at least 1, got {value}.")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
