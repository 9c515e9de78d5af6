"""POST /v1/completions: prompts in, one engine request per prompt, choices out (index = prompt * n + k).

Non-streaming answers one `CompletionResponse`; streaming answers server-sent events, one
`CompletionStreamResponse` per new piece of a choice, an optional usage chunk, then `data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from jaxserve.entrypoints.openai_protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
    random_id,
)
from jaxserve.entrypoints.serving_engine import (
    EnginePrompt,
    OpenAIServing,
    RequestParams,
    clamp_logprob,
    prompt_logprobs_of,
    stream_error,
    streamable_text,
)
from jaxserve.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        self.check_request(request)
        prompts = self.completion_prompts(request.prompt, request.add_special_tokens)
        params = [self.sampling_params(request, p) for p in prompts]
        request_id, created = random_id("cmpl"), int(time.time())
        stream = self.generate(prompts, params, request_id, request.priority)
        if request.stream:
            return self._stream(request, prompts, params, stream, request_id, created)
        finals = await self.final_outputs(stream, len(prompts))
        return self._response(request, prompts, finals, request_id, created)

    # ----- non-streaming ------------------------------------------------------------------------
    def _response(
        self, request: CompletionRequest, prompts: list[EnginePrompt], finals: list[RequestOutput],
        request_id: str, created: int,
    ) -> CompletionResponse:
        choices, num_generated = [], 0
        for i, (prompt, result) in enumerate(zip(prompts, finals, strict=True)):
            for output in result.outputs:
                num_generated += len(output.token_ids)
                echo = prompt.text if request.echo else ""
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._logprobs(request, prompt, result, output, 0, 0, with_prompt=bool(request.echo))
                choices.append(CompletionResponseChoice(
                    index=i * request.n + output.index, text=echo + output.text, logprobs=logprobs,
                    finish_reason=output.finish_reason, stop_reason=output.stop_reason,
                    prompt_logprobs=prompt_logprobs_of(result) if request.prompt_logprobs is not None else None,
                ))
        choices.sort(key=lambda c: c.index)
        num_prompt = sum(len(p.token_ids) for p in prompts)
        return CompletionResponse(
            id=request_id, created=created, model=self.served_model_name, choices=choices,
            usage=UsageInfo.of(num_prompt, num_generated),
        )

    # ----- streaming ----------------------------------------------------------------------------
    async def _stream(
        self, request: CompletionRequest, prompts: list[EnginePrompt], params: list[RequestParams],
        stream: AsyncIterator[tuple[int, RequestOutput]], request_id: str, created: int,
    ) -> AsyncIterator[str]:
        sent_chars: dict[int, int] = {}  # choice index -> characters of output text sent
        sent_tokens: dict[int, int] = {}
        options = request.stream_options
        continuous_usage = bool(options and options.include_usage and options.continuous_usage_stats)
        try:
            async for i, result in stream:
                for output in result.outputs:
                    index = i * request.n + output.index
                    choice = self._choice_delta(request, prompts[i], params[i], result, output, index,
                                                sent_chars, sent_tokens)
                    if choice is None:
                        continue
                    chunk = CompletionStreamResponse(
                        id=request_id, created=created, model=self.served_model_name, choices=[choice])
                    if continuous_usage:
                        chunk.usage = UsageInfo.of(len(prompts[i].token_ids), sent_tokens[index])
                    yield f"data: {chunk.model_dump_json()}\n\n"
            if options and options.include_usage:
                usage = UsageInfo.of(sum(len(p.token_ids) for p in prompts), sum(sent_tokens.values()))
                final = CompletionStreamResponse(
                    id=request_id, created=created, model=self.served_model_name, choices=[], usage=usage)
                yield f"data: {final.model_dump_json()}\n\n"
        except Exception as err:  # noqa: BLE001 - a started stream reports any error as an event, then ends
            yield stream_error(err)
        yield "data: [DONE]\n\n"

    def _choice_delta(
        self, request: CompletionRequest, prompt: EnginePrompt, params: RequestParams, result: RequestOutput,
        output: CompletionOutput, index: int, sent_chars: dict[int, int], sent_tokens: dict[int, int],
    ) -> CompletionResponseStreamChoice | None:
        """What choice `index` gained since the last chunk, or None when nothing can be sent yet."""
        first = index not in sent_chars
        prev_chars, prev_tokens = sent_chars.get(index, 0), sent_tokens.get(index, 0)
        text = streamable_text(output, params)
        delta_text = text[prev_chars:]
        new_tokens = len(output.token_ids) - prev_tokens
        if not delta_text and not new_tokens and output.finish_reason is None and not (first and request.echo):
            return None
        echo = prompt.text if (first and request.echo) else ""
        logprobs = None
        if request.logprobs is not None:
            offset = len(prompt.text) if request.echo else 0
            logprobs = self._logprobs(request, prompt, result, output, prev_tokens, offset + prev_chars,
                                      with_prompt=first and bool(request.echo))
        sent_chars[index], sent_tokens[index] = len(text), len(output.token_ids)
        return CompletionResponseStreamChoice(
            index=index, text=echo + delta_text, logprobs=logprobs,
            finish_reason=output.finish_reason, stop_reason=output.stop_reason,
        )

    # ----- logprobs -----------------------------------------------------------------------------
    def _logprobs(
        self, request: CompletionRequest, prompt: EnginePrompt, result: RequestOutput, output: CompletionOutput,
        first_token: int, text_offset: int, *, with_prompt: bool,
    ) -> CompletionLogProbs:
        """OpenAI's legacy logprobs of output tokens [first_token:], preceded by the prompt's when echoing."""
        token_ids = list(output.token_ids[first_token:])
        steps = list((output.logprobs or [])[first_token:])
        if with_prompt:
            prompt_steps = result.prompt_logprobs or [None] * len(prompt.token_ids)
            token_ids, steps = prompt.token_ids + token_ids, list(prompt_steps) + steps
            text_offset = 0
        logprobs = CompletionLogProbs()
        for token_id, step in zip(token_ids, steps, strict=False):
            entry = step.get(token_id) if step else None
            token = self.token_text(token_id, entry)
            logprobs.tokens.append(token)
            logprobs.text_offset.append(text_offset)
            text_offset += len(token)
            if entry is None:
                logprobs.token_logprobs.append(None)
                logprobs.top_logprobs.append(None)
                continue
            logprobs.token_logprobs.append(clamp_logprob(entry.logprob))
            ranked = self.top_logprobs(step, request.logprobs)
            top = {self.token_text(t, lp): clamp_logprob(lp.logprob) for t, lp in ranked}
            top.setdefault(token, clamp_logprob(entry.logprob))  # the sampled token is always included
            logprobs.top_logprobs.append(top)
        return logprobs
