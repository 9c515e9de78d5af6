"""EngineInfo: what the serving layer needs to know of an engine it may not hold in its own process.

Place in the data flow: the HTTP handlers (`entrypoints/serving_engine.py`) tokenize prompts and check
requests against the engine's limits before anything reaches the engine; `AsyncLLMEngine` builds this from
its in-process `LLMEngine`, the engine core process sends it to `engine_core/core_client.py` once it is warm.
"""

from __future__ import annotations

import dataclasses

from jaxserve.core.buckets import BucketGrid
from jaxserve.engine.request_checks import (
    EngineLimits,
    check_beam_search_request,
    check_priority,
    check_sampling_request,
)
from jaxserve.sampling_params import BeamSearchParams, SamplingParams


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    tokenizer: object
    max_model_len: int
    vocab_size: int
    limits: EngineLimits
    grid: BucketGrid
    kv_event_sources: dict = dataclasses.field(default_factory=dict)  # `GET /kv_event_sources` (none: {})

    @classmethod
    def of(cls, engine) -> EngineInfo:
        """From an `LLMEngine`."""
        publisher = engine.kv_event_publisher
        sources = {} if publisher is None else publisher.sources()
        return cls(engine.tokenizer, engine.max_model_len, engine.model_config.vocab_size, engine.limits, engine.grid,
                   sources)

    def check_request(self, params: SamplingParams | BeamSearchParams, num_prompt_tokens: int,
                      priority: int = 0) -> None:
        """The engine's own checks of a request (ValueError with vLLM's messages), before it is sent."""
        check_priority(priority, self.limits)
        if isinstance(params, BeamSearchParams):
            check_beam_search_request(params, num_prompt_tokens, self.limits)
        else:
            check_sampling_request(params, self.limits)
        self.grid.check_request(num_prompt_tokens, params.max_tokens)
