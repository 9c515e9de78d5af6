"""POST /v1/chat/completions: the conversation through the chat template, one engine request, n choices.

Non-streaming answers one `ChatCompletionResponse`; streaming answers server-sent events: a first chunk
per choice with the assistant role, content deltas, the finish reason, an optional usage chunk, then
`data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from jaxserve.engine.async_engine import EngineDeadError
from jaxserve.entrypoints.openai_protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from jaxserve.entrypoints.serving_engine import (
    EnginePrompt,
    OpenAIServing,
    RequestParams,
    ServingError,
    clamp_logprob,
    stream_error,
    streamable_text,
)
from jaxserve.outputs import CompletionOutput, RequestOutput

ROLE = "assistant"


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        self.check_model(request.model)
        prompt = self.chat_prompt(request)
        params = self.sampling_params(request, prompt)
        request_id, created = random_id("chatcmpl"), int(time.time())
        stream = self.generate([prompt], [params], request_id)
        if request.stream:
            return self._stream(request, prompt, params, stream, request_id, created)
        (final,) = await self.final_outputs(stream, 1)
        return self._response(request, prompt, final, request_id, created)

    def _response(
        self, request: ChatCompletionRequest, prompt: EnginePrompt, final: RequestOutput, request_id: str,
        created: int,
    ) -> ChatCompletionResponse:
        choices = [
            ChatCompletionResponseChoice(
                index=output.index, message=ChatMessage(role=ROLE, content=output.text),
                logprobs=self._logprobs(request, output, 0), finish_reason=output.finish_reason,
                stop_reason=output.stop_reason,
            )
            for output in final.outputs
        ]
        num_prompt = len(prompt.token_ids)
        num_generated = sum(len(o.token_ids) for o in final.outputs)
        return ChatCompletionResponse(
            id=request_id, created=created, model=self.served_model_name,
            choices=sorted(choices, key=lambda c: c.index),
            usage=UsageInfo.of(num_prompt, num_generated),
        )

    async def _stream(
        self, request: ChatCompletionRequest, prompt: EnginePrompt, params: RequestParams,
        stream: AsyncIterator[tuple[int, RequestOutput]], request_id: str, created: int,
    ) -> AsyncIterator[str]:
        options = request.stream_options
        continuous_usage = bool(options and options.include_usage and options.continuous_usage_stats)
        num_prompt = len(prompt.token_ids)
        sent_chars: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}

        def event(choices: list, usage: UsageInfo | None = None) -> str:
            chunk = ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.served_model_name, choices=choices, usage=usage)
            return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"

        try:
            for index in range(request.n):
                role = ChatCompletionResponseStreamChoice(
                    index=index, delta=DeltaMessage(role=ROLE, content=""), logprobs=None, finish_reason=None)
                yield event([role], UsageInfo.of(num_prompt, 0) if continuous_usage else None)
            async for _, result in stream:
                for output in result.outputs:
                    choice = self._choice_delta(request, params, output, sent_chars, sent_tokens)
                    if choice is not None:
                        usage = UsageInfo.of(num_prompt, sent_tokens[output.index]) if continuous_usage else None
                        yield event([choice], usage)
            if options and options.include_usage:
                yield event([], UsageInfo.of(num_prompt, sum(sent_tokens.values())))
        except (ValueError, ServingError, EngineDeadError) as err:
            yield stream_error(err)
        yield "data: [DONE]\n\n"

    def _choice_delta(
        self, request: ChatCompletionRequest, params: RequestParams, output: CompletionOutput,
        sent_chars: dict[int, int], sent_tokens: dict[int, int],
    ) -> ChatCompletionResponseStreamChoice | None:
        index = output.index
        prev_chars, prev_tokens = sent_chars.get(index, 0), sent_tokens.get(index, 0)
        text = streamable_text(output, params)
        delta_text = text[prev_chars:]
        if not delta_text and len(output.token_ids) == prev_tokens and output.finish_reason is None:
            return None
        sent_chars[index], sent_tokens[index] = len(text), len(output.token_ids)
        return ChatCompletionResponseStreamChoice(
            index=index, delta=DeltaMessage(content=delta_text), logprobs=self._logprobs(request, output, prev_tokens),
            finish_reason=output.finish_reason, stop_reason=output.stop_reason,
        )

    def _logprobs(
        self, request: ChatCompletionRequest, output: CompletionOutput, first_token: int
    ) -> ChatCompletionLogProbs | None:
        """OpenAI's chat logprobs of output tokens [first_token:]: each token with its top alternatives."""
        if not request.logprobs:
            return None
        content = []
        steps = (output.logprobs or [])[first_token:]
        for token_id, step in zip(output.token_ids[first_token:], steps, strict=False):
            entry = step.get(token_id)
            token = self.token_text(token_id, entry)
            top = [self._logprob(t, lp) for t, lp in self.top_logprobs(step, request.top_logprobs or 0)]
            content.append(ChatCompletionLogProbsContent(
                token=token, logprob=clamp_logprob(entry.logprob) if entry else -9999.0,
                bytes=list(token.encode("utf-8", errors="replace")), top_logprobs=top,
            ))
        return ChatCompletionLogProbs(content=content)

    def _logprob(self, token_id: int, logprob) -> ChatCompletionLogProb:
        token = self.token_text(token_id, logprob)
        return ChatCompletionLogProb(
            token=token, logprob=clamp_logprob(logprob.logprob), bytes=list(token.encode("utf-8", errors="replace")))

