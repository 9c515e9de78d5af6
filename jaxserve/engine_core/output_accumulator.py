"""Rebuilds cumulative RequestOutputs from the deltas the engine core process sends.

Place in the data flow: the core sends each request's outputs as deltas without the prompt
(`core_process.py`); `core_client.py` keeps one accumulator per request that asked for cumulative outputs
and hands its streams what an in-process engine would have given: every completion's whole text, tokens and
logprobs so far, the prompt logprobs once sent, and the prompt itself.
"""

from __future__ import annotations

import dataclasses

from jaxserve.outputs import CompletionOutput, RequestOutput


class CumulativeOutputs:
    def __init__(self, prompt: str | None, prompt_token_ids: list[int]):
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.completions: dict[int, CompletionOutput] = {}
        self.prompt_logprobs = None

    def add(self, delta: RequestOutput) -> RequestOutput:
        for part in delta.outputs:
            self._extend(part)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        completions = [_copy(self.completions[i]) for i in sorted(self.completions)]
        return dataclasses.replace(delta, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                                   outputs=completions, prompt_logprobs=self.prompt_logprobs)

    def _extend(self, part: CompletionOutput) -> None:
        whole = self.completions.get(part.index)
        if whole is None:
            self.completions[part.index] = _copy(part)
            return
        whole.text += part.text
        whole.token_ids.extend(part.token_ids)
        if part.logprobs is not None:
            whole.logprobs = whole.logprobs or []
            whole.logprobs.extend(part.logprobs)
        whole.cumulative_logprob = part.cumulative_logprob
        whole.finish_reason, whole.stop_reason = part.finish_reason, part.stop_reason


def with_prompt(output: RequestOutput, prompt: str | None, prompt_token_ids: list[int]) -> RequestOutput:
    """A delta or final output with its prompt put back."""
    return dataclasses.replace(output, prompt=prompt, prompt_token_ids=prompt_token_ids)


def _copy(completion: CompletionOutput) -> CompletionOutput:
    return dataclasses.replace(completion, token_ids=list(completion.token_ids),
                               logprobs=None if completion.logprobs is None else list(completion.logprobs))
