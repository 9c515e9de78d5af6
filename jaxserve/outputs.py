"""What the engine returns (vLLM's classes and fields).

RequestOutput holds one CompletionOutput per returned sample (n of them); `logprobs` are per generated
token a dict token id -> Logprob (the sampled token first, then the top-k), `prompt_logprobs` the same per
prompt token (None for the first). BeamSearchOutput is what `LLM.beam_search` returns.
"""

from __future__ import annotations

import dataclasses

SampleLogprobs = list[dict[int, "Logprob"]]
PromptLogprobs = list[dict[int, "Logprob"] | None]


@dataclasses.dataclass
class Logprob:
    """One token's log probability, its rank in the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    metrics: dict | None = None
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache (vLLM's field)


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt followed by the generated tokens, `text` decodes all of them
    (as vLLM's `LLM.beam_search` does), `logprobs` holds per generated token its candidates' Logprobs."""

    tokens: list[int]
    logprobs: SampleLogprobs
    cum_logprob: float
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """The beam_width best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]
