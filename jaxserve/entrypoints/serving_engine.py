"""Shared ground of the HTTP handlers, between the request models and the AsyncLLMEngine.

It checks the model name, tokenizes prompts (text, token ids or a chat conversation through the chat
template), rejects a prompt that cannot fit before anything reaches the engine (vLLM's wording), merges
the streams of several prompts, holds back streamed text that a stop string could still cut, and
formats logprobs. Errors are `ServingError`s, which the app answers with OpenAI's error JSON.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel

from jaxserve.engine.async_engine import InvalidRequestError
from jaxserve.engine.request_checks import truncated_prompt
from jaxserve.engine_core.core_client import ServerEngine
from jaxserve.entrypoints.openai_protocol import PromptLogprob
from jaxserve.logger import init_logger
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import BeamSearchParams, SamplingParams

logger = init_logger("jaxserve.entrypoints.serving_engine")

MIN_LOGPROB = -9999.0  # OpenAI's JSON has no -inf
UNTRUSTED_CHAT_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                           "Refused request with untrusted chat template.")  # vLLM's words
RequestParams = SamplingParams | BeamSearchParams  # use_beam_search makes a request a beam search


class ServingError(Exception):
    """A request the server refuses; becomes `{"error": {...}}` with this status code."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
}


def error_body(message: str, status: HTTPStatus, param: str | None = None) -> dict:
    """OpenAI's error object, with vLLM's error type names. A lone surrogate a message quotes from the request is
    escaped (`\\ud800`): the body must encode as UTF-8."""
    err_type = _ERROR_TYPES.get(HTTPStatus(status), HTTPStatus(status).phrase.replace(" ", "") + "Error")
    return {"error": {"message": _valid_text(message), "type": err_type, "param": param and _valid_text(param),
                      "code": int(status)}}


def _valid_text(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def stream_error(err: Exception) -> str:
    """An error after a stream has started: one `data:` event with the error object (as vLLM). A refused request
    (`ServingError`, the engine's `InvalidRequestError`) keeps its status; any other error is the server's, 500."""
    status = getattr(err, "status", HTTPStatus.INTERNAL_SERVER_ERROR)
    if status == HTTPStatus.INTERNAL_SERVER_ERROR:
        logger.error("a stream failed: %r", err)
    return f"data: {json.dumps(error_body(str(err), status))}\n\n"


@dataclasses.dataclass
class EnginePrompt:
    text: str | None
    token_ids: list[int]

    def as_engine_input(self) -> dict:
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


class OpenAIServing:
    def __init__(self, engine: ServerEngine, served_model_name: str, chat_template: str | None = None,
                 trust_request_chat_template: bool = False):
        """`chat_template`: the server's (`--chat-template`), used where a request names none; None: the
        tokenizer's own. `trust_request_chat_template` (`--trust-request-chat-template`, vLLM's): a request may
        bring its own Jinja template; without it, one that does is refused."""
        self.engine = engine
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        self.info = engine.info
        self.tokenizer = engine.info.tokenizer
        self.max_model_len = engine.info.max_model_len
        self.served_model_name = served_model_name
        self.vocab_size = engine.info.vocab_size

    # ----- checks -------------------------------------------------------------------------------
    def check_request(self, request: Any) -> None:
        """What every handler checks first: the request's text is valid Unicode, then its model name."""
        check_unicode(request)
        self.check_model(getattr(request, "model", None))

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise ServingError(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, "model")

    def check_token_ids(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ServingError("The prompt is empty: it must contain at least one token.", param="prompt")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ServingError(f"Token id {bad[0]} is out of vocabulary (size {self.vocab_size}).", param="prompt")

    def sampling_params(self, request: Any, prompt: EnginePrompt) -> RequestParams:
        """The request's SamplingParams (BeamSearchParams with use_beam_search) for one prompt, checked
        against the engine's limits here, so that a bad request is a 400 before any stream starts."""
        self.truncate_prompt(prompt, getattr(request, "truncate_prompt_tokens", None))
        default_max_tokens = max(self.max_model_len - len(prompt.token_ids), 1)
        try:
            if request.use_beam_search:
                params = request.to_beam_search_params(default_max_tokens)
            else:
                params = request.to_sampling_params(default_max_tokens)
        except (ValueError, TypeError) as err:
            raise ServingError(str(err)) from err
        self.check_params(params, prompt, getattr(request, "priority", 0))
        return params

    def check_params(self, params: RequestParams, prompt: EnginePrompt, priority: int = 0) -> None:
        """The engine's own request checks, with vLLM's context-length message."""
        try:
            self.info.check_request(params, len(prompt.token_ids), priority)
        except ValueError as err:
            raise ServingError(str(err)) from err

    # ----- prompts ------------------------------------------------------------------------------
    def truncate_prompt(self, prompt: EnginePrompt, truncate_prompt_tokens: int | None) -> None:
        """vLLM's truncate_prompt_tokens: the prompt keeps its last k tokens (its text becomes theirs), before any
        length check; a k above max_model_len is a 400 with vLLM's message."""
        try:
            kept = truncated_prompt(prompt.token_ids, truncate_prompt_tokens, self.max_model_len)
        except ValueError as err:
            raise ServingError(str(err), param="truncate_prompt_tokens") from err
        if len(kept) < len(prompt.token_ids):
            prompt.text, prompt.token_ids = self.tokenizer.decode(kept), kept

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def text_prompt(self, text: str, add_special_tokens: bool = True) -> EnginePrompt:
        prompt = EnginePrompt(text, self.encode(text, add_special_tokens))
        self.check_token_ids(prompt.token_ids)
        return prompt

    def token_prompt(self, token_ids: list[int]) -> EnginePrompt:
        self.check_token_ids(token_ids)
        return EnginePrompt(self.tokenizer.decode(token_ids), list(token_ids))

    def completion_prompts(self, prompt: str | list, add_special_tokens: bool) -> list[EnginePrompt]:
        """OpenAI's four prompt forms: a string, strings, token ids, lists of token ids."""
        if isinstance(prompt, str):
            return [self.text_prompt(prompt, add_special_tokens)]
        if all(isinstance(p, str) for p in prompt):
            return [self.text_prompt(p, add_special_tokens) for p in prompt]
        if all(isinstance(p, int) for p in prompt):
            return [self.token_prompt(prompt)]
        return [self.token_prompt(p) for p in prompt]

    def chat_prompt(self, request: Any) -> EnginePrompt:
        """The conversation rendered by the chat template with the request's tools (`render_chat`), tokenized."""
        return self.text_prompt(self.render_chat(request), bool(request.add_special_tokens))

    def render_chat(self, request: Any, with_tools: bool = True) -> str:
        """The text of the conversation rendered with the chat template (the request's own, the server's, or the
        model's), and the request's tools, if any and `with_tools` (tool-aware templates render them)."""
        self.check_request_chat_template(request)
        messages = [_message_dict(m) for m in request.messages]
        kwargs = dict(request.chat_template_kwargs or {})
        template = request.chat_template if request.chat_template is not None else self.chat_template
        if template is not None:
            kwargs["chat_template"] = template
        tools = getattr(request, "tools", None)
        if tools and with_tools:
            kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in tools]
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message, **kwargs,
            )
        except Exception as err:  # no template, a template error, bad kwargs: the request's fault
            raise ServingError(f"Cannot apply the chat template: {err}") from err

    def check_request_chat_template(self, request: Any) -> None:
        """vLLM's refusal of a template the request brings (its `chat_template`, or one in `chat_template_kwargs`)
        unless the server trusts them: a Jinja template is code the server runs."""
        if self.trust_request_chat_template:
            return
        kwargs = request.chat_template_kwargs or {}
        if request.chat_template is not None or kwargs.get("chat_template") is not None:
            raise ServingError(UNTRUSTED_CHAT_TEMPLATE, param="chat_template")

    # ----- generation ---------------------------------------------------------------------------
    def generate(
        self, prompts: list[EnginePrompt], params: list[RequestParams], request_id: str, priority: int = 0
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        streams = [
            self.engine.generate(p.as_engine_input(), sp, f"{request_id}-{i}", priority)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        return merge_streams(streams)

    @staticmethod
    async def final_outputs(stream: AsyncIterator[tuple[int, RequestOutput]], num: int) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * num
        try:
            async for i, output in stream:
                finals[i] = output
        except InvalidRequestError as err:  # the engine refused the request; any other error is the server's
            raise ServingError(str(err)) from err
        return finals  # type: ignore[return-value]

    # ----- formatting ---------------------------------------------------------------------------
    def token_text(self, token_id: int, logprob: Logprob | None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])

    @staticmethod
    def top_logprobs(step: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
        """The `num` most likely entries of one position's {token_id: Logprob} (the sampled token comes
        first there, whatever its rank), best first."""
        ranked = sorted(step.items(), key=lambda kv: (math.inf if kv[1].rank is None else kv[1].rank, -kv[1].logprob))
        return ranked[:num]


def check_unicode(value: Any) -> None:
    """Refuses text holding a lone surrogate anywhere in a request (JSON's `"\\ud800"` escape gives one), naming the
    first place: no tokenizer, stop string match, chat template or engine core message takes it. Walks the request
    without recursion (a deeply nested body must not be a RecursionError)."""
    pending: list[tuple[Any, str | None]] = [(value, None)]
    while pending:
        item, param = pending.pop()
        if isinstance(item, str):
            _check_text(item, param)
            continue
        if isinstance(item, BaseModel):
            children = [(v, _child(param, k)) for k, v in {**item.__dict__, **(item.__pydantic_extra__ or {})}.items()]
        elif isinstance(item, dict):
            children = [(v, _child(param, str(k))) for k, v in item.items()]
            for key in item:
                _check_text(key, param)
        elif isinstance(item, (list, tuple)):
            children = [(v, f"{param or ''}[{i}]") for i, v in enumerate(item)]
        else:
            continue
        pending.extend(reversed(children))  # first child on top


def _check_text(text: Any, param: str | None) -> None:
    match = _LONE_SURROGATE.search(text) if isinstance(text, str) else None
    if match is not None:
        raise ServingError(f"{param or 'The request'} holds a lone surrogate (U+{ord(match.group()):04X}), which is "
                           "not valid Unicode text.", param=param and param.split(".")[0].split("[")[0])


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _child(param: str | None, name: str) -> str:
    return name if param is None else f"{param}.{name}"


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def prompt_logprobs_of(result: RequestOutput) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs` extra (a completion choice's, a chat response's): per prompt position, the
    {token id: Logprob} of its token and the top ones (None at position 0)."""
    steps = result.prompt_logprobs
    if steps is None:
        return None
    return [None if step is None else {
        token_id: PromptLogprob(logprob=clamp_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
        for token_id, lp in step.items()
    } for step in steps]


def streamable_text(output: CompletionOutput, params: RequestParams) -> str:
    """The text that can be sent now: while unfinished, the tail a stop string could still remove is held
    back (vLLM's stop buffer); a finished output is final (beam search only gives final outputs)."""
    stop = getattr(params, "stop", None)
    if output.finish_reason is not None or not stop or params.include_stop_str_in_output:
        return output.text
    hold = max(len(s) for s in stop) - 1
    return output.text[: max(len(output.text) - hold, 0)]


def _message_dict(message: Any) -> dict:
    data = message.model_dump(exclude_none=True)
    content = data.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text":
                raise ServingError(f"Only text content parts are supported, got {part.get('type')!r}.")
            if not isinstance(part.get("text"), str):
                raise ServingError("A text content part needs a `text` string.")
            texts.append(part["text"])
        data["content"] = "\n".join(texts)
    for call in data.get("tool_calls") or []:  # an assistant turn's calls: templates take arguments as objects
        _arguments_as_object(call)
    return data


def _arguments_as_object(call: Any) -> None:
    """OpenAI sends a call's arguments as JSON text; chat templates (Qwen's, Llama's) write them with `tojson`,
    so they get the object, as vLLM gives them."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise ServingError(f"A tool call's arguments must be JSON text, got {arguments!r}.",
                               param="messages") from err


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Interleaves several streams as (stream index, item). Closing or cancelling the merged stream
    cancels every stream still open, which aborts its request in the engine."""
    pending: dict[asyncio.Future, int] = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, item
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
