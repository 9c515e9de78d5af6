"""POST /generate: vLLM's demo protocol. The JSON body holds `prompt`, `stream` and SamplingParams fields
by their own names (`n`, `temperature`, `max_tokens`, ...); the answer is `{"text": [prompt + output for
each of the n outputs]}`, and with `"stream": true` one such object per line, cumulative.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import TypeAdapter, ValidationError

from jaxserve.entrypoints.openai_protocol import random_id
from jaxserve.entrypoints.serving_engine import EnginePrompt, OpenAIServing, ServingError, streamable_text
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

_SERVER_OWNED_FIELDS = ("output_kind",)  # how outputs are delivered is the server's business


class GenerateServing(OpenAIServing):
    async def generate_text(self, body: Any) -> dict | AsyncIterator[bytes]:
        if not isinstance(body, dict):
            raise ServingError("The request body must be a JSON object.")
        body = dict(body)
        prompt_text = body.pop("prompt", None)
        if not isinstance(prompt_text, str):
            raise ServingError("`prompt` is required and must be a string.", param="prompt")
        stream = body.pop("stream", False)
        if not isinstance(stream, bool):
            raise ServingError("`stream` must be a boolean.", param="stream")
        if body.pop("use_beam_search", False) is not False:
            raise ServingError("use_beam_search is not supported by this engine yet.", param="use_beam_search")
        prompt = self.text_prompt(prompt_text)
        params = self._sampling_params(body, prompt)
        outputs = self.generate([prompt], [params], random_id("generate"))
        if stream:
            return self._stream(outputs, params)
        (final,) = await self.final_outputs(outputs, 1)
        return {"text": _texts(final, params)}

    def _sampling_params(self, fields: dict, prompt: EnginePrompt) -> SamplingParams:
        known = {f.name for f in dataclasses.fields(SamplingParams)} - set(_SERVER_OWNED_FIELDS)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ServingError(f"Unknown sampling parameter(s): {', '.join(unknown)}.", param=unknown[0])
        try:
            params = _sampling_params_adapter().validate_python(fields)
        except ValidationError as err:
            raise ServingError(_validation_message(err), param=_first_loc(err)) from err
        try:
            self.llm_engine.grid.check_request(len(prompt.token_ids), params.max_tokens)
        except ValueError as err:
            raise ServingError(str(err)) from err
        return params

    async def _stream(self, outputs: AsyncIterator[tuple[int, RequestOutput]], params: SamplingParams):
        try:
            async for _, result in outputs:
                yield (json.dumps({"text": _texts(result, params)}) + "\n").encode()
        except ValueError as err:
            yield (json.dumps({"error": str(err)}) + "\n").encode()


def _texts(result: RequestOutput, params: SamplingParams) -> list[str]:
    prompt = result.prompt or ""
    return [prompt + streamable_text(output, params) for output in sorted(result.outputs, key=lambda o: o.index)]


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
