"""POST /v1/chat/completions: the conversation through the chat template, one engine request, n choices.

Non-streaming answers one `ChatCompletionResponse`; streaming answers server-sent events: a first chunk
per choice with the assistant role, content deltas, the finish reason, an optional usage chunk, then
`data: [DONE]`. Tools: the request's tools are checked (`tool_choice.py`) and rendered by the chat template
(for "auto", a template that leaves them out is refused: the model would never see them); a tool_choice that
forces calls constrains the output with structured outputs (under `--reasoning-parser`, once the reasoning has
ended); each choice's text is read by a
`ChoiceOutputParser` (`chat_output.py`: reasoning, tool calls, content), whole or streamed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

from jaxserve.entrypoints.chat_output import AUTO_NEEDS_FLAGS, ChatParserOptions, ChoiceOutputParser, finish_reason
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
from jaxserve.entrypoints.reasoning_parsers import get_reasoning_parser
from jaxserve.entrypoints.serving_engine import (
    EnginePrompt,
    OpenAIServing,
    RequestParams,
    ServingError,
    clamp_logprob,
    prompt_logprobs_of,
    stream_error,
    streamable_text,
)
from jaxserve.entrypoints.tool_choice import check_tool_schemas, forced_calls_constraint
from jaxserve.outputs import CompletionOutput, RequestOutput

ROLE = "assistant"
TEMPLATE_IGNORES_TOOLS = ("the chat template does not render tools, so the model cannot call them: \"auto\" tool "
                          "choice needs a tool-aware template (the request's or the server's chat_template)")


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, parser_options: ChatParserOptions | None = None, **kwargs):
        """``parser_options``: the server's `--enable-auto-tool-choice`, `--tool-call-parser` and
        `--reasoning-parser`."""
        super().__init__(*args, **kwargs)
        self.parser_options = parser_options or ChatParserOptions()

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        self.check_request(request)
        self._check_tools(request)
        prompt = self.chat_prompt(request)
        self._check_template_renders_tools(request, prompt.text)
        first_parser = ChoiceOutputParser.for_request(request, self.parser_options)
        request = self._with_tool_constraints(request, first_parser)
        # checks n (at most max_num_seqs) before per-choice work
        params = self._after_reasoning(self.sampling_params(request, prompt), prompt)
        parsers = [first_parser] + [ChoiceOutputParser.for_request(request, self.parser_options)
                                    for _ in range(request.n - 1)]
        request_id, created = random_id("chatcmpl"), int(time.time())
        stream = self.generate([prompt], [params], request_id, request.priority)
        if request.stream:
            return self._stream(request, prompt, params, stream, request_id, created, parsers)
        (final,) = await self.final_outputs(stream, 1)
        return self._response(request, prompt, final, request_id, created, parsers)

    def _check_tools(self, request: ChatCompletionRequest) -> None:
        """Tools whose schemas the grammar engine takes; "auto" only on a server that parses calls."""
        if not request.tools:
            return
        try:
            check_tool_schemas(request.tools)
        except ValueError as err:
            raise ServingError(str(err), param="tools") from err
        if request.tool_choice == "auto" and not self.parser_options.auto_tool_choice:
            raise ServingError(AUTO_NEEDS_FLAGS, param="tool_choice")

    def _check_template_renders_tools(self, request: ChatCompletionRequest, prompt_text: str) -> None:
        """An "auto" tool choice needs a chat template that renders the tools (else the model would never see
        them): the prompt's text must differ from the conversation rendered without them (compared as text; the
        check tokenizes nothing)."""
        if not request.tools or request.tool_choice != "auto":
            return
        if prompt_text == self.render_chat(request, with_tools=False):
            raise ServingError(TEMPLATE_IGNORES_TOOLS, param="tools")

    @staticmethod
    def _with_tool_constraints(request: ChatCompletionRequest, parser: ChoiceOutputParser) -> ChatCompletionRequest:
        """The request with tool_choice's output constraint (forced calls) and the special tokens its parser
        needs kept in the text."""
        update = {}
        if request.forces_tool_calls:
            if request.response_format is not None or request.structured_outputs is not None or any(
                    getattr(request, f"guided_{kind}") is not None for kind in ("json", "regex", "choice", "grammar")):
                raise ServingError("tool_choice \"required\" or a named function constrains the output itself: "
                                   "give no response_format or structured outputs with it", param="tool_choice")
            update["structured_outputs"] = forced_calls_constraint(request)
        if parser.keeps_special_tokens:
            update["skip_special_tokens"] = False
        return request.model_copy(update=update) if update else request

    def _after_reasoning(self, params: RequestParams, prompt: EnginePrompt) -> RequestParams:
        """Under a reasoning parser, the request's constraint waits for the parser's end marker (vLLM's rule), unless
        the prompt ended the reasoning already; the engine's `structured_outputs_config.enable_in_reasoning` may
        still apply it from the first token."""
        name = self.parser_options.reasoning_parser
        constraint = getattr(params, "structured_outputs", None)  # none on BeamSearchParams
        if name is None or constraint is None:
            return params
        parser = get_reasoning_parser(name)
        if not parser.ended_in_prompt(prompt.text or ""):
            params.structured_outputs = dataclasses.replace(constraint, reasoning_end=parser.end_marker)
        return params

    def _response(
        self, request: ChatCompletionRequest, prompt: EnginePrompt, final: RequestOutput, request_id: str,
        created: int, parsers: list[ChoiceOutputParser],
    ) -> ChatCompletionResponse:
        choices = []
        for output in final.outputs:
            parsed = parsers[output.index].message(output.text)
            message = ChatMessage(role=ROLE, content=parsed.content, reasoning_content=parsed.reasoning_content,
                                  tool_calls=parsed.tool_calls)
            choices.append(ChatCompletionResponseChoice(
                index=output.index, message=message, logprobs=self._logprobs(request, output, 0),
                finish_reason=finish_reason(output.finish_reason, bool(parsed.tool_calls)),
                stop_reason=output.stop_reason,
            ))
        num_prompt = len(prompt.token_ids)
        num_generated = sum(len(o.token_ids) for o in final.outputs)
        return ChatCompletionResponse(
            id=request_id, created=created, model=self.served_model_name,
            choices=sorted(choices, key=lambda c: c.index),
            usage=UsageInfo.of(num_prompt, num_generated),
            prompt_logprobs=prompt_logprobs_of(final) if request.prompt_logprobs is not None else None,
        )

    async def _stream(
        self, request: ChatCompletionRequest, prompt: EnginePrompt, params: RequestParams,
        stream: AsyncIterator[tuple[int, RequestOutput]], request_id: str, created: int,
        parsers: list[ChoiceOutputParser],
    ) -> AsyncIterator[str]:
        options = request.stream_options
        continuous_usage = bool(options and options.include_usage and options.continuous_usage_stats)
        num_prompt = len(prompt.token_ids)
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
                    choice = self._choice_delta(request, params, output, parsers[output.index], sent_tokens)
                    if choice is not None:
                        usage = UsageInfo.of(num_prompt, sent_tokens[output.index]) if continuous_usage else None
                        yield event([choice], usage)
            if options and options.include_usage:
                yield event([], UsageInfo.of(num_prompt, sum(sent_tokens.values())))
        except Exception as err:  # noqa: BLE001 - a started stream reports any error as an event, then ends
            yield stream_error(err)
        yield "data: [DONE]\n\n"

    def _choice_delta(
        self, request: ChatCompletionRequest, params: RequestParams, output: CompletionOutput,
        parser: ChoiceOutputParser, sent_tokens: dict[int, int],
    ) -> ChatCompletionResponseStreamChoice | None:
        index = output.index
        prev_tokens = sent_tokens.get(index, 0)
        finished = output.finish_reason is not None
        delta = parser.delta(streamable_text(output, params), finished)
        if delta is None and len(output.token_ids) == prev_tokens and not finished:
            return None
        sent_tokens[index] = len(output.token_ids)
        return ChatCompletionResponseStreamChoice(
            index=index, delta=delta or DeltaMessage(content=""), logprobs=self._logprobs(request, output, prev_tokens),
            finish_reason=finish_reason(output.finish_reason, parser.streamed_calls), stop_reason=output.stop_reason,
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

