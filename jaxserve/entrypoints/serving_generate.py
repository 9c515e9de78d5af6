"""POST /generate: vLLM's demo protocol. The JSON body holds `prompt`, `stream` and SamplingParams fields
by their own names (`n`, `temperature`, `max_tokens`, ...); the answer is `{"text": [prompt + output for
each of the n outputs]}`, and with `"stream": true` one such object per line, cumulative.
`"use_beam_search": true` makes it a beam search of `best_of` (default `n`) beams, the best `n` answered
best first (the semantics of vLLM's SamplingParams when the demo server was written).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import TypeAdapter, ValidationError

from jaxserve.entrypoints.openai_protocol import random_id
from jaxserve.entrypoints.serving_engine import (
    EnginePrompt,
    OpenAIServing,
    RequestParams,
    ServingError,
    check_unicode,
    streamable_text,
)
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import BeamSearchParams, SamplingParams

_SERVER_OWNED_FIELDS = ("output_kind",)  # how outputs are delivered is the server's business


class GenerateServing(OpenAIServing):
    async def generate_text(self, body: Any) -> dict | AsyncIterator[bytes]:
        if not isinstance(body, dict):
            raise ServingError("The request body must be a JSON object.")
        check_unicode(body)
        body = dict(body)
        prompt_text = body.pop("prompt", None)
        if not isinstance(prompt_text, str):
            raise ServingError("`prompt` is required and must be a string.", param="prompt")
        stream = body.pop("stream", False)
        if not isinstance(stream, bool):
            raise ServingError("`stream` must be a boolean.", param="stream")
        use_beam_search = body.pop("use_beam_search", False)
        if not isinstance(use_beam_search, bool):
            raise ServingError("`use_beam_search` must be a boolean.", param="use_beam_search")
        prompt = self.text_prompt(prompt_text)
        if use_beam_search:
            params, num_returned = self._beam_search_params(body, prompt)
        else:
            params, num_returned = self._sampling_params(body, prompt), None
        outputs = self.generate([prompt], [params], random_id("generate"))
        if stream:
            return self._stream(outputs, params, num_returned)
        (final,) = await self.final_outputs(outputs, 1)
        return {"text": _texts(final, params, num_returned)}

    def _sampling_params(self, fields: dict, prompt: EnginePrompt) -> SamplingParams:
        params = _validated_sampling_params(fields)
        self.truncate_prompt(prompt, params.truncate_prompt_tokens)
        self.check_params(params, prompt)
        return params

    def _beam_search_params(self, fields: dict, prompt: EnginePrompt) -> tuple[BeamSearchParams, int]:
        """vLLM's demo semantics: `best_of` (default `n`) beams, the best `n` returned; the other fields
        validate as SamplingParams fields. Returns the params and n."""
        n, best_of = fields.pop("n", 1), fields.pop("best_of", None)
        length_penalty = fields.pop("length_penalty", 1.0)
        checked = _validated_sampling_params(fields)
        if checked.structured_outputs is not None:
            raise ServingError("structured outputs are not supported with beam search", param="structured_outputs")
        self.truncate_prompt(prompt, checked.truncate_prompt_tokens)
        if not _is_count(n):
            raise ServingError(f"n must be at least 1, got {n}.", param="n")
        if best_of is not None and not (_is_count(best_of) and best_of >= n):
            raise ServingError(f"best_of must be greater than or equal to n, got n={n} and best_of={best_of}.",
                               param="best_of")
        try:
            params = BeamSearchParams(
                beam_width=best_of or n, max_tokens=checked.max_tokens or self.max_model_len - len(prompt.token_ids),
                ignore_eos=checked.ignore_eos, temperature=checked.temperature, length_penalty=length_penalty,
                include_stop_str_in_output=checked.include_stop_str_in_output, stop=checked.stop,
                stop_token_ids=checked.stop_token_ids, logprobs=checked.logprobs, seed=checked.seed,
            )
        except (ValueError, TypeError) as err:
            raise ServingError(str(err)) from err
        self.check_params(params, prompt)
        return params, n

    async def _stream(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]], params: RequestParams, num_returned: int | None
    ) -> AsyncIterator[bytes]:
        try:
            async for _, result in outputs:
                yield (json.dumps({"text": _texts(result, params, num_returned)}) + "\n").encode()
        except Exception as err:  # noqa: BLE001 - a started stream reports any error as a line, then ends
            yield (json.dumps({"error": str(err)}) + "\n").encode()


def _texts(result: RequestOutput, params: RequestParams, num_returned: int | None) -> list[str]:
    """prompt + output for each output by index (beams come best first), the first `num_returned`."""
    prompt = result.prompt or ""
    outputs = sorted(result.outputs, key=lambda o: o.index)[:num_returned]
    return [prompt + streamable_text(output, params) for output in outputs]


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _validated_sampling_params(fields: dict) -> SamplingParams:
    known = {f.name for f in dataclasses.fields(SamplingParams)} - set(_SERVER_OWNED_FIELDS)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ServingError(f"Unknown sampling parameter(s): {', '.join(unknown)}.", param=unknown[0])
    try:
        return _sampling_params_adapter().validate_python(fields)
    except ValidationError as err:
        raise ServingError(_validation_message(err), param=_first_loc(err)) from err


_ADAPTER: TypeAdapter | None = None


def _sampling_params_adapter() -> TypeAdapter:
    """Validates field types from SamplingParams' own annotations, then runs its __post_init__ checks."""
    global _ADAPTER
    if _ADAPTER is None:
        _ADAPTER = TypeAdapter(SamplingParams)
    return _ADAPTER


def _validation_message(err: ValidationError) -> str:
    messages = []
    for item in err.errors():
        message = item["msg"].removeprefix("Value error, ")
        loc = ".".join(str(x) for x in item["loc"])
        messages.append(f"{loc}: {message}" if loc else message)
    return "; ".join(messages)


def _first_loc(err: ValidationError) -> str | None:
    locs = [item["loc"] for item in err.errors() if item["loc"]]
    return str(locs[0][0]) if locs else None
