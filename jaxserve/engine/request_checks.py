"""Checks of one request against the engine's limits, before it is queued (vLLM's messages).

`SamplingParams` / `BeamSearchParams` validate themselves; what depends on the model and the engine
(vocabulary size, max_logprobs, max_num_seqs, the KV pool) is checked here by `LLMEngine.add_request`.
"""

from __future__ import annotations

import dataclasses

from jaxserve.math_utils import cdiv
from jaxserve.sampling_params import BeamSearchParams, SamplingParams


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    max_logprobs: int
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int
    scheduling_policy: str = "fcfs"


def check_priority(priority, limits: EngineLimits) -> None:
    """A request's priority: an integer, and 0 unless the engine schedules by priority (vLLM's message)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and limits.scheduling_policy != "priority":
        raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")


def check_sampling_request(params: SamplingParams, limits: EngineLimits) -> None:
    if params.n > limits.max_num_seqs:  # vLLM's bound: a request's n sequences run at once
        raise ValueError(f"n cannot be greater than max_num_seqs({limits.max_num_seqs}), but got {params.n}.")
    for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        value = getattr(params, name)
        if value is not None and value > limits.max_logprobs:
            raise ValueError(
                f"Requested {kind} logprobs of {value}, which is greater than max allowed: {limits.max_logprobs}"
            )
    if params.top_k > limits.vocab_size:
        raise ValueError(
            f"top_k cannot be greater than vocabulary size({limits.vocab_size}), but got {params.top_k}."
        )
    _check_in_vocab(params.logit_bias or (), "logit_bias", limits.vocab_size)
    if params.allowed_token_ids is not None and _out_of_vocab(params.allowed_token_ids, limits.vocab_size):
        raise ValueError("allowed_token_ids contains out-of-vocab token id!")
    _check_in_vocab(params.stop_token_ids, "stop_token_ids", limits.vocab_size)
    if params.best_of > limits.max_num_seqs:
        raise ValueError(
            f"best_of={params.best_of} sequences cannot run at once: max_num_seqs is {limits.max_num_seqs}"
        )


def truncated_prompt(token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: k = max_model_len; None: the whole prompt);
    a k above max_model_len is refused with vLLM's message."""
    k = truncate_prompt_tokens
    if k is None:
        return token_ids
    if k == -1:
        k = max_model_len
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({max_model_len})."
                         " Please, select a smaller truncation size.")
    return token_ids[-k:]


def check_beam_search_request(params: BeamSearchParams, num_prompt_tokens: int, limits: EngineLimits) -> None:
    width = params.beam_width
    if params.logprobs is not None and params.logprobs > limits.max_logprobs:
        raise ValueError(
            f"Requested sample logprobs of {params.logprobs}, which is greater than max allowed: {limits.max_logprobs}"
        )
    if 2 * width > limits.max_logprobs:
        raise ValueError(
            f"beam_width={width} needs the top {2 * width} logprobs per step, more than max_logprobs="
            f"{limits.max_logprobs}; raise max_logprobs or lower beam_width"
        )
    if width > limits.max_num_seqs:
        raise ValueError(f"beam_width={width} beams cannot run at once: max_num_seqs is {limits.max_num_seqs}")
    blocks = width * cdiv(num_prompt_tokens + params.max_tokens, limits.block_size)
    if blocks > limits.num_kv_blocks:
        raise ValueError(
            f"beam_width={width} beams of up to {num_prompt_tokens + params.max_tokens} tokens need up to "
            f"{blocks} KV blocks, more than the pool's {limits.num_kv_blocks}"
        )


def _out_of_vocab(token_ids, vocab_size: int) -> list[int]:
    return sorted(t for t in token_ids if not 0 <= t < vocab_size)


def _check_in_vocab(token_ids, field: str, vocab_size: int) -> None:
    """vLLM's message for token ids outside the vocabulary in ``field``."""
    invalid = _out_of_vocab(token_ids, vocab_size)
    if invalid:
        raise ValueError(
            f"token_id(s) {invalid} in {field} contain out-of-vocab token ids. Vocabulary size: {vocab_size}"
        )
