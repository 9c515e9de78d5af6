"""Speculative decoding's options: vLLM's `speculative_config` (`--speculative-config '{...}'`).

Place in the data flow: `EngineConfig.speculative_config` holds a `SpeculativeConfig` (parsed from a dict or a
JSON object, every key checked); the bucket grid makes room for its drafts (`EngineConfig.speculative_grid`),
and the engine builds the proposer it names (`jaxserve.speculative`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from jaxserve.config.dict_options import as_dict, check_known_keys

METHODS = ("ngram", "draft_model", "suffix")
# vLLM's other methods, and why they are not served here
UNSUPPORTED_METHODS = {
    "eagle": "EAGLE heads need trained weights that jaxserve cannot load yet",
    "eagle3": "EAGLE-3 heads need trained weights that jaxserve cannot load yet",
    "mtp": "multi-token prediction heads are not loaded by jaxserve's model families yet",
    "medusa": "Medusa heads are not supported",
    "mlp_speculator": "MLP speculators are not supported",
}
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram size when neither bound is given
# Rows in a step past which no row gets drafts: decode on this CPU is compute-bound from 8 rows up, where
# verifying a draft costs what a decoded token does (docs/benchmarks/speculative.md measures the crossover)
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
# vLLM's suffix decoding defaults (Arctic Inference's); num_speculative_tokens defaults to the tree depth
SUFFIX_DEFAULTS = {"suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 10000,
                   "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}
METHOD_KEYS = {"ngram": ("prompt_lookup_min", "prompt_lookup_max"), "draft_model": ("model",),
               "suffix": tuple(SUFFIX_DEFAULTS)}
KNOWN_KEYS = ("method", "num_speculative_tokens", "disable_by_batch_size",
              *(key for keys in METHOD_KEYS.values() for key in keys))


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """`speculative_config`: what `LLM(..., speculative_config={...})` and `jaxserve serve --speculative-config '{...}'`
    take, with vLLM's keys. The engine builds its proposer from it (`jaxserve/speculative/`), the grid makes room
    in its mixed buckets for the drafts' sample positions (`EngineConfig.speculative_grid`).

    ``num_speculative_tokens`` drafts at most per row and step; ``disable_by_batch_size``: a step with more
    decoding rows than this speculates for none of them (vLLM V0's option of that name; V1 has none).
    ``method`` "ngram" looks drafts up in the sequence (``prompt_lookup_min/max``); "draft_model" (the method
    when only ``model`` is given, as in vLLM) runs the small model at ``model``, of the target's vocabulary;
    "suffix" follows frequency-counted suffix tries of the sequence and of earlier responses (the
    ``suffix_decoding_*`` keys, `jaxserve/speculative/suffix.py`)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str | None = None  # the draft model (method "draft_model"): what `LLM(model=...)` takes
    # method "suffix": tries at most this deep (match + drafts), responses of this many finished sequences kept,
    # at most factor x match length drafts, drafts while their estimated probability is at least min_token_prob
    suffix_decoding_max_tree_depth: int = SUFFIX_DEFAULTS["suffix_decoding_max_tree_depth"]
    suffix_decoding_max_cached_requests: int = SUFFIX_DEFAULTS["suffix_decoding_max_cached_requests"]
    suffix_decoding_max_spec_factor: float = SUFFIX_DEFAULTS["suffix_decoding_max_spec_factor"]
    suffix_decoding_min_token_prob: float = SUFFIX_DEFAULTS["suffix_decoding_min_token_prob"]

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SpeculativeConfig:
        check_known_keys(config, list(KNOWN_KEYS), "speculative_config")
        method = config.get("method") or ("draft_model" if config.get("model") else None)
        if method in UNSUPPORTED_METHODS:
            raise ValueError(f"speculative_config: method {method!r} is not supported: {UNSUPPORTED_METHODS[method]}")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {method!r}")
        _check_method_keys(method, config)
        suffix = {key: config.get(key, default) for key, default in SUFFIX_DEFAULTS.items()}
        num_speculative_tokens = config.get("num_speculative_tokens")
        if num_speculative_tokens is None and method == "suffix":
            num_speculative_tokens = suffix["suffix_decoding_max_tree_depth"]  # vLLM's default for suffix
        if num_speculative_tokens is None:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        low, high = low or high or DEFAULT_PROMPT_LOOKUP, high or low or DEFAULT_PROMPT_LOOKUP  # vLLM's rule
        return cls(method, num_speculative_tokens, low, high,
                   config.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE), config.get("model"), **suffix)

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """A config from what a user gives: itself, a dict, or a JSON object (the command line's)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = as_dict(value, "speculative_config")
        return cls.from_dict(value)

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
                     "suffix_decoding_max_tree_depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
        self._check_suffix_numbers()
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft_model" and not (isinstance(self.model, str | os.PathLike) and str(self.model)):
            raise ValueError(f"speculative_config: method 'draft_model' needs the draft's path in 'model', got "
                             f"{self.model!r}")

    def _check_suffix_numbers(self) -> None:
        cached, factor = self.suffix_decoding_max_cached_requests, self.suffix_decoding_max_spec_factor
        probability = self.suffix_decoding_min_token_prob
        if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
            raise ValueError(f"speculative_config: suffix_decoding_max_cached_requests must be an integer >= 0, got "
                             f"{cached!r}")
        if not _is_number(factor) or not factor > 0:
            raise ValueError(f"speculative_config: suffix_decoding_max_spec_factor must be a number > 0, got "
                             f"{factor!r}")
        if not _is_number(probability) or not 0 <= probability <= 1:
            raise ValueError(f"speculative_config: suffix_decoding_min_token_prob must be a number in [0, 1], got "
                             f"{probability!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_method_keys(method: str, config: dict[str, Any]) -> None:
    """A key of another method is a mistake worth naming (vLLM ignores it)."""
    for other, keys in METHOD_KEYS.items():
        given = [key for key in keys if other != method and config.get(key) is not None]
        if given:
            raise ValueError(f"speculative_config: {', '.join(map(repr, given))} apply to method {other!r}, not "
                             f"{method!r}")
