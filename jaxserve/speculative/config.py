"""`speculative_config`: what `LLM(..., speculative_config={...})` and `jaxserve serve --speculative-config '{...}'`
take, with vLLM's keys; validated here so that a bad value fails at start-up with a message naming it.

The engine reads it to build its proposer (`ngram.py`), to compile its mixed buckets with room for the drafts'
sample positions (`runner/input_batch.py`) and to decide, each step, which decoding rows get drafts
(`disable_by_batch_size`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

METHODS = ("ngram",)
# vLLM's other methods, and why they are not served here
UNSUPPORTED_METHODS = {
    "draft_model": "not built yet: use method 'ngram'",
    "eagle": "EAGLE heads need trained weights that jaxserve cannot load yet",
    "eagle3": "EAGLE-3 heads need trained weights that jaxserve cannot load yet",
    "mtp": "multi-token prediction heads are not loaded by jaxserve's model families yet",
    "medusa": "Medusa heads are not supported",
    "mlp_speculator": "MLP speculators are not supported",
    "suffix": "suffix decoding is not built yet: use method 'ngram'",
}
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram size when neither bound is given
# Rows in a step past which no row gets drafts: decode on this CPU is compute-bound from 8 rows up, where
# verifying a draft costs what a decoded token does (docs/benchmarks/speculative.md measures the crossover)
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
KNOWN_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
              "model")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """``num_speculative_tokens`` drafts at most per row and step; ``disable_by_batch_size``: a step with more
    decoding rows than this speculates for none of them (vLLM V0's option of that name; V1 has none)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SpeculativeConfig:
        unknown = sorted(set(config) - set(KNOWN_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(KNOWN_KEYS)}")
        method = config.get("method") or ("draft_model" if config.get("model") else None)
        if method in UNSUPPORTED_METHODS:
            raise ValueError(f"speculative_config: method {method!r} is not supported: {UNSUPPORTED_METHODS[method]}")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {method!r}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        low, high = low or high or DEFAULT_PROMPT_LOOKUP, high or low or DEFAULT_PROMPT_LOOKUP  # vLLM's rule
        return cls(method, config["num_speculative_tokens"], low, high,
                   config.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE))

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """A config from what a user gives: itself, a dict, or a JSON object (the command line's)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config: not a JSON object: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or a JSON object, got {type(value).__name__}")
        return cls.from_dict(value)

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
