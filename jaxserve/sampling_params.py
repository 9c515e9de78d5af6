"""SamplingParams: how one request is decoded, with vLLM's field names, defaults and validation.

The engine turns these into per-request arrays for the on-device sampler (`sampler.py`) and into
host-side stop checks (`detokenizer.py`). A new value never recompiles anything.
"""

from __future__ import annotations

import dataclasses
from enum import IntEnum

_SAMPLING_EPS = 1e-5


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # every output holds only what is new since the previous one
    FINAL_ONLY = 2  # only the finished output is returned


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}.")
        _check(self.n == 1, "n > 1 is not supported yet; only n=1.")
        _check(self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}.")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}.")
        _check(
            isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1),
            f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.",
        )
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            f"max_tokens must be at least 1, got {self.max_tokens}.",
        )
        _check(self.min_tokens >= 0, f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings.")
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def effective_top_k(self) -> int:
        """0 means no top-k filtering (vLLM accepts 0 and -1 for that)."""
        return 1 if self.is_greedy else max(self.top_k, 0)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
