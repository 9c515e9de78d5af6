"""Logprobs on the host: the device's per-row top K (`runner/logprobs.py`) turned into vLLM's dicts.

A request group reads a step's sampled token's logprob and rank and the top K ids and logprobs, and keeps,
per position, `{token_id: Logprob(logprob, rank, decoded_token)}`: the chosen token first, then the top
`logprobs` the request asked for (K = max_logprobs is the step's static shape; a request keeps the first k).
"""

from __future__ import annotations

import numpy as np

from jaxserve.outputs import Logprob


class TokenTexts:
    """`decoded_token` of each token id (vLLM decodes each id alone), cached: the vocabulary is finite."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) or ""
            self._cache[token_id] = text
        return text


def logprob_dict(
    token_id: int, token_logprob: float, token_rank: int, top_ids: np.ndarray, top_logprobs: np.ndarray,
    num_top: int, texts: TokenTexts,
) -> dict[int, Logprob]:
    """vLLM's dict for one position: the chosen token first, then the top `num_top` (ranks 1..num_top)."""
    entries = {token_id: Logprob(float(token_logprob), int(token_rank), texts(token_id))}
    top = zip(top_ids[:num_top].tolist(), top_logprobs[:num_top].tolist(), strict=True)
    for rank, (top_id, top_logprob) in enumerate(top, start=1):
        entries[top_id] = Logprob(top_logprob, rank, texts(top_id))
    return entries
