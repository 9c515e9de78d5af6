"""transformers' reference runs of a model directory, in float32: its logits and its greedy continuation of one
prompt, what the engine's outputs are checked against (the tests and the GPU check scripts). transformers and
torch (the `test` extra) are imported when called."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def hf_logits(path: Path, token_ids: list[int]) -> np.ndarray:
    """transformers' float32 logits [T, V] for one sequence."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


def hf_greedy(path: Path, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (new tokens only) of one prompt, float32."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return greedy_continuation(model, token_ids, max_new_tokens)


def greedy_continuation(model, token_ids: list[int], max_new_tokens: int, cache=None) -> list[int]:
    """The greedy continuation (exactly ``max_new_tokens`` new tokens) of one prompt by a loaded transformers
    model; ``cache``: the KV cache it generates with (a `transformers.DynamicCache` that rounds K/V, say)."""
    import inspect

    import torch

    # transformers names the argument `cache` since 5.2x, `past_key_values` before (the GPU image's 5.17)
    cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    extra = {} if cache is None else {cache_argument: cache}
    with torch.no_grad():
        out = model.generate(torch.tensor([token_ids]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **extra)
    return out[0, len(token_ids):].tolist()
