"""Pydantic models of the HTTP API: OpenAI's completions and chat requests with vLLM's extra sampling
fields, their responses and stream chunks, /tokenize and /detokenize, /v1/models and the error body.

Requests become `SamplingParams` here (`to_sampling_params`), field for field with vLLM's mapping; the
serving modules (`serving_completions.py`, `serving_chat.py`) turn engine outputs into the responses.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from jaxserve.logger import init_logger
from jaxserve.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

logger = init_logger("jaxserve.entrypoints.openai_protocol")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")  # as vLLM: unknown request fields are ignored, with a warning

    @model_validator(mode="wrap")
    @classmethod
    def _log_ignored_fields(cls, data, handler):
        """vLLM's warning naming the fields a request sent that no field (or alias) of the model takes."""
        result = handler(data)
        if isinstance(data, dict) and cls.model_config.get("extra") == "ignore":
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            ignored = sorted(str(key) for key in data if key not in known)
            if ignored:
                logger.warning("The following fields were present in the request but ignored: %s", ignored)
        return result


# ----- errors ---------------------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ----- shared request pieces ------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's `response_format`: text, json_object, or json_schema (its `schema`; jaxserve always enforces it,
    `strict` or not)."""

    type: str
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_type(self):
        if self.type not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format type {self.type!r} is not supported; use 'text', 'json_object' "
                             "or 'json_schema'")
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema")
        return self

    def to_structured_outputs(self) -> dict | None:
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json": self.json_schema.json_schema}
        return None


class SamplingFields(OpenAIBaseModel):
    """The sampling fields completions and chat share: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = Field(default_factory=list)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extras
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    priority: int = 0  # under --scheduling-policy priority: lower first
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self

    def to_beam_search_params(self, default_max_tokens: int) -> BeamSearchParams:
        """vLLM's mapping: n beams; temperature defaults to 1.0 as in sampling. stop, stop_token_ids, logprobs and
        seed, which vLLM drops here, are honoured (`BeamSearchParams`)."""
        if self._structured_outputs() is not None:
            raise ValueError("structured outputs are not supported with beam search")
        max_tokens = self.requested_max_tokens()
        return BeamSearchParams(
            beam_width=self.n, max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            ignore_eos=self.ignore_eos, temperature=1.0 if self.temperature is None else self.temperature,
            length_penalty=self.length_penalty, include_stop_str_in_output=self.include_stop_str_in_output,
            stop=self.stop, stop_token_ids=self.stop_token_ids, logprobs=self.requested_logprobs(), seed=self.seed,
        )

    def requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    def requested_logprobs(self) -> int | None:
        """The top logprobs asked for each generated token (None: none)."""
        raise NotImplementedError

    def _sampling_kwargs(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> dict:
        return {
            "n": self.n,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k is None else self.top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "ignore_eos": self.ignore_eos,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logit_bias": self.logit_bias,  # SamplingParams makes the keys ints and clamps
            "structured_outputs": self._structured_outputs(),
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words,
        }

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one constraint the request gives (several are a ValueError, as an invalid one is)."""
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        sources = {
            "response_format": self.response_format.to_structured_outputs() if self.response_format else None,
            "structured_outputs": self.structured_outputs,
            "guided_*": {kind: value for kind, value in guided.items() if value is not None} or None,
        }
        given = {name: value for name, value in sources.items() if value}
        if len(given) > 1:
            raise ValueError(f"give one structured outputs constraint, got {' and '.join(given)}")
        if not given:
            return None
        try:
            return StructuredOutputsParams(**next(iter(given.values())))
        except TypeError as err:  # an unknown field in structured_outputs
            raise ValueError(f"invalid structured_outputs: {err}") from None


# ----- completions ----------------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    prompt: list[int] | list[list[int]] | str | list[str]
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    prompt_logprobs: int | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_fields(self):
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("`logprobs` must be a positive value.")
        if self.suffix is not None:
            raise ValueError("suffix is not currently supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = self.logprobs  # echo with logprobs returns the prompt's logprobs too
        kwargs = self._sampling_kwargs(max_tokens, self.logprobs, prompt_logprobs)
        kwargs["best_of"] = self.best_of
        return SamplingParams(**kwargs)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0

    @classmethod
    def of(cls, num_prompt: int, num_generated: int) -> UsageInfo:
        return cls(prompt_tokens=num_prompt, completion_tokens=num_generated, total_tokens=num_prompt + num_generated)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's Logprob object, as its `prompt_logprobs` extra returns it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None  # vLLM's extra


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ----- chat -----------------------------------------------------------------------------------------


class ChatMessageParam(OpenAIBaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: handed to the chat template
    role: str
    content: str | list[dict[str, Any]] | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageParam]
    tools: list[ChatCompletionToolsParam] | None = None
    # vLLM's default: "auto" when tools are given, else "none" (set by _check_tools)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    prompt_logprobs: int | None = None  # vLLM's extra: answered in the response's prompt_logprobs
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_fields(self):
        if self.top_logprobs is not None:
            if self.top_logprobs < 0:
                raise ValueError("`top_logprobs` must be a positive value.")
            if self.top_logprobs > 0 and not self.logprobs:
                raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        if self.prompt_logprobs and self.stream:
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        if not self.messages:
            raise ValueError("messages must contain at least one message")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        """tool_choice defaults as vLLM's; one that needs tools without them, or names a function the tools do
        not define, is refused naming the problem."""
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"
        elif self.tool_choice != "none" and not self.tools:
            raise ValueError("When using `tool_choice`, `tools` must be set.")
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tools must have distinct function names, got {names}")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, which is not "
                             f"among the tools ({', '.join(names)})")

    @property
    def forces_tool_calls(self) -> bool:
        """tool_choice "required" or a named function: the output is constrained to calls (`tool_choice.py`)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = self.requested_max_tokens()
        max_tokens = default_max_tokens if max_tokens is None else max_tokens
        return SamplingParams(**self._sampling_kwargs(max_tokens, self.requested_logprobs(), self.prompt_logprobs))


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # the arguments object as JSON text, as OpenAI sends it


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """One streamed piece of tool call `index`: its first piece carries id, type and name; later pieces
    carry fragments of the arguments text (streams are dumped with exclude_unset, so unset fields stay out)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None  # vLLM's extra, filled by a reasoning parser
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _omit_unused(self, handler):
        """An answer without reasoning or tool calls is dumped as before these fields existed."""
        data = handler(self)
        if self.reasoning_content is None:
            data.pop("reasoning_content", None)
        if not self.tool_calls:
            data.pop("tool_calls", None)
        return data


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None  # vLLM's extra


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ----- models, tokenizer ----------------------------------------------------------------------------


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's two forms: `prompt` (completion style) or `messages` (chat template applied)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_form(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of `prompt` and `messages` must be given")
        if self.continue_final_message and self.add_generation_prompt and self.messages is not None:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return self


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
