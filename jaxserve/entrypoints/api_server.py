"""The HTTP server: a FastAPI app over one AsyncLLMEngine (or, with --engine-core-process, an AsyncMPEngine whose
engine core runs in a process of its own), run by uvicorn.

Routes: /generate (vLLM's demo protocol), /v1/completions, /v1/chat/completions, /v1/models, /health,
/version, /tokenize, /detokenize, /metrics (Prometheus), and for routers /get_server_info, /kv_event_sources,
/get_load and /reset_prefix_cache (also as /flush_cache). Every error is OpenAI's error JSON: 400 for
a bad request (invalid JSON, wrong types, invalid values, text that is not valid Unicode, a prompt that cannot
fit), 401 without the API key when one is set (every route but /health, /version and /metrics), 404 for an
unknown model or route, 500 for the server's own failure (a failed engine step: never a 400), 503 once the
engine is dead (then `launcher.ApiServer` stops the server and the process exits 1). A client that disconnects
aborts its request, which frees its KV blocks.

    python -m jaxserve.entrypoints.api_server --model path/to/model --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import sys
from collections.abc import AsyncIterator, Awaitable
from http import HTTPStatus

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxserve
from jaxserve.distributed.multihost import distributed_init_requested
from jaxserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineStepError
from jaxserve.engine.chat_template import load_chat_template
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine_core.core_client import AsyncMPEngine, ServerEngine
from jaxserve.engine_core.data_parallel import DataParallelEngine
from jaxserve.entrypoints.args import (
    add_engine_args,
    add_server_args,
    chat_parser_options_from_args,
    engine_config_from_args,
    model_from_args,
)
from jaxserve.entrypoints.chat_output import ChatParserOptions
from jaxserve.entrypoints.launcher import ApiServer
from jaxserve.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from jaxserve.entrypoints.serving_chat import OpenAIServingChat
from jaxserve.entrypoints.serving_completions import OpenAIServingCompletion
from jaxserve.entrypoints.serving_engine import ServingError, error_body
from jaxserve.entrypoints.serving_generate import GenerateServing
from jaxserve.entrypoints.serving_tokenization import OpenAIServingTokenization
from jaxserve.logger import init_logger
from jaxserve.metrics.prometheus import ServingMetrics
from jaxserve.replication.serving_hosts import FollowingHost, follow, lead, serving_role

logger = init_logger("jaxserve.api_server")

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
PUBLIC_PATHS = ("/health", "/version", "/metrics")  # answered without the API key (probes, scrapers)
CLIENT_CLOSED_REQUEST = 499

router = APIRouter()


# ----- routes -------------------------------------------------------------------------------------


@router.get("/health")
async def health(raw_request: Request) -> Response:
    """200 while the engine can serve; 503 once it cannot (its core process died, a host was lost), as vLLM
    answers, with the reason in OpenAI's error object."""
    reason = raw_request.app.state.engine.dead_reason
    if reason is None:
        return Response(status_code=200)
    return _error_response(reason, HTTPStatus.SERVICE_UNAVAILABLE)


@router.get("/version")
async def version() -> dict:
    return {"version": jaxserve.__version__}


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    body = raw_request.app.state.metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def show_models(raw_request: Request) -> ModelList:
    state = raw_request.app.state
    card = ModelCard(id=state.served_model_name, root=state.model_path, max_model_len=state.max_model_len)
    return ModelList(data=[card])


@router.get("/get_server_info")
async def server_info(raw_request: Request) -> dict:
    """What vLLM's router reads of a worker for KV-aware routing (`--policy kv_aware`): the model it serves and the
    block size of the KV cache events it publishes."""
    state = raw_request.app.state
    return {"model_id": state.served_model_name, "model_path": state.model_path,
            "kv_block_size": state.engine.info.grid.block_size, "max_model_len": state.max_model_len}


@router.get("/kv_event_sources")
async def kv_event_sources(raw_request: Request) -> dict:
    """Where the engine publishes its KV cache events, by data-parallel rank (vLLM's answer; {}: none)."""
    return raw_request.app.state.engine.info.kv_event_sources


@router.post("/reset_prefix_cache")
@router.post("/flush_cache")
async def reset_prefix_cache(raw_request: Request) -> dict:
    """Drops the cached KV blocks that no running request holds (vLLM's /reset_prefix_cache; /flush_cache is what
    vLLM's router calls on every worker), and says how many."""
    return {"num_blocks_dropped": await raw_request.app.state.engine.reset_prefix_cache()}


@router.get("/get_load")
async def get_load(raw_request: Request) -> dict:
    """The requests the engine holds, running and waiting: a worker's load as vLLM's router reads it."""
    scheduler = raw_request.app.state.engine.make_stats().scheduler
    return {"load": scheduler.num_running_reqs + scheduler.num_waiting_reqs}


@router.post("/tokenize")
async def tokenize(request: TokenizeRequest, raw_request: Request):
    return raw_request.app.state.tokenization.tokenize(request)


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request):
    return raw_request.app.state.tokenization.detokenize(request)


@router.post("/generate")
async def generate(raw_request: Request) -> Response:
    body = await _json_body(raw_request)
    serving: GenerateServing = raw_request.app.state.generate
    return await _respond(raw_request, serving.generate_text(body), media_type="application/x-ndjson")


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    serving: OpenAIServingCompletion = raw_request.app.state.completions
    return await _respond(raw_request, serving.create_completion(request), media_type="text/event-stream")


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    serving: OpenAIServingChat = raw_request.app.state.chat
    return await _respond(raw_request, serving.create_chat_completion(request), media_type="text/event-stream")


async def _json_body(raw_request: Request):
    try:
        return json.loads(await raw_request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ServingError(f"The request body is not valid JSON: {err}") from err
    except RecursionError:
        raise ServingError("The request body is not valid JSON: nested too deeply") from None


async def _respond(raw_request: Request, handler: Awaitable, *, media_type: str) -> Response:
    """Runs a handler until it answers or the client goes away (then its requests are aborted).

    A handler answers a pydantic model or dict (sent as JSON) or an async iterator (streamed; starlette
    cancels it when the client disconnects, which aborts the request the same way)."""
    result = await _cancel_on_disconnect(raw_request, handler)
    if result is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type=media_type)
    if isinstance(result, dict):
        return JSONResponse(result)
    return Response(result.model_dump_json(), media_type="application/json")


async def _cancel_on_disconnect(raw_request: Request, handler: Awaitable):
    handler_task = asyncio.ensure_future(handler)
    disconnect_task = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    done, _ = await asyncio.wait({handler_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
    for task in (handler_task, disconnect_task):
        if task not in done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if handler_task in done:
        return handler_task.result()
    logger.info("client disconnected from %s; its requests were aborted", raw_request.url.path)
    return None


async def _wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


# ----- errors and authentication -------------------------------------------------------------------


def _error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, HTTPStatus(status), param), status_code=status)


async def _serving_error(_: Request, err: ServingError) -> JSONResponse:
    return _error_response(err.message, err.status, err.param)


async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
    messages, param = [], None
    for item in err.errors():
        if item.get("type") == "json_invalid":
            reason = (item.get("ctx") or {}).get("error", "JSON decode error")
            return _error_response(f"The request body is not valid JSON: {reason}", HTTPStatus.BAD_REQUEST)
        loc = [str(x) for x in item.get("loc", ()) if x != "body"]
        param = param or (loc[0] if loc else None)
        message = str(item.get("msg", "invalid value")).removeprefix("Value error, ")
        messages.append(f"{'.'.join(loc)}: {message}" if loc else message)
    return _error_response("; ".join(messages) or "invalid request", HTTPStatus.BAD_REQUEST, param)


async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
    return _error_response(str(err.detail), err.status_code)


async def _engine_error(_: Request, err: EngineDeadError | EngineStepError) -> JSONResponse:
    """503 once the engine is dead; 500 when the step that ran the request failed."""
    return _error_response(str(err), err.status)


async def _internal_error(raw_request: Request, err: Exception) -> JSONResponse:
    logger.exception("internal error answering %s", raw_request.url.path, exc_info=err)
    return _error_response(f"Internal server error: {type(err).__name__}", HTTPStatus.INTERNAL_SERVER_ERROR)


class APIKeyMiddleware:
    """Answers 401 unless `Authorization: Bearer <api key>`; probes and /metrics stay open (pure ASGI, so
    streaming and disconnect detection pass through untouched)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        given = Headers(scope=scope).get("authorization", "").encode("latin-1")
        if not secrets.compare_digest(given, self.expected):
            response = _error_response("Unauthorized: a valid API key is required.", HTTPStatus.UNAUTHORIZED)
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


# ----- the app ------------------------------------------------------------------------------------


def build_app(
    engine: ServerEngine, *, served_model_name: str, api_key: str | None = None, model_path: str | None = None,
    chat_template: str | None = None, chat_parsers: ChatParserOptions | None = None,
    trust_request_chat_template: bool = False,
) -> FastAPI:
    """The app over a warm engine; its metrics registry is its own. `chat_template`: the template text for chats
    whose request names none (default: the tokenizer's). `chat_parsers`: tool call and reasoning parsing.
    `trust_request_chat_template`: requests may bring their own chat template (vLLM's flag; default: refused)."""
    metrics = ServingMetrics(engine.make_stats, engine.backend_compiles)
    engine.observer = metrics

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await engine.shutdown()

    app = FastAPI(title="jaxserve", version=jaxserve.__version__, lifespan=lifespan)
    app.include_router(router)
    state = app.state
    state.engine, state.metrics, state.served_model_name = engine, metrics, served_model_name
    state.model_path, state.max_model_len = model_path, engine.info.max_model_len
    state.completions = OpenAIServingCompletion(engine, served_model_name)
    trusted = {"trust_request_chat_template": trust_request_chat_template}
    state.chat = OpenAIServingChat(engine, served_model_name, chat_template, parser_options=chat_parsers, **trusted)
    state.generate = GenerateServing(engine, served_model_name)
    state.tokenization = OpenAIServingTokenization(engine, served_model_name, chat_template, **trusted)
    app.add_exception_handler(ServingError, _serving_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(EngineDeadError, _engine_error)
    app.add_exception_handler(EngineStepError, _engine_error)
    app.add_exception_handler(Exception, _internal_error)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="jaxserve's OpenAI-compatible HTTP server")
    add_engine_args(parser)
    add_server_args(parser)
    return parser


def run_server(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    chat_template = load_chat_template(args.chat_template)  # a bad path fails before the model loads
    chat_parsers = chat_parser_options_from_args(args)  # so does a tool parser flag without its partner
    engine = start_engine(config, args.engine_core_process)
    if isinstance(engine, FollowingHost):
        return engine.run()  # multi-host: host 0 serves; this host makes its device calls
    model = model_from_args(args)
    served_model_name = args.served_model_name or model or EMBEDDED_MODEL_NAME
    api_key = args.api_key or os.environ.get("JAXSERVE_API_KEY")
    app = build_app(engine, served_model_name=served_model_name, api_key=api_key, model_path=model,
                    chat_template=chat_template, chat_parsers=chat_parsers,
                    trust_request_chat_template=args.trust_request_chat_template)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    server = ApiServer(config, engine, served_model_name)
    try:
        server.run()
    finally:
        engine.close()
    return 1 if server.engine_died else 0


def start_engine(config, core_process: bool) -> ServerEngine | DataParallelEngine | FollowingHost:
    """Loads the model and warms up every bucket, in a core process of its own or in this one; with
    data_parallel_size > 1, in that many core processes. Multi-host, host 0 gets the engine that leads the others
    (`replication/serving_hosts.py`), any other host a `FollowingHost`."""
    if config.data_parallel_size > 1:
        if distributed_init_requested(config.distributed_init):
            raise ValueError("--data-parallel-size with --distributed-init: a multi-host server runs one engine "
                             "over every host; serve several of them behind vllm-router instead")
        return DataParallelEngine.launch(config)
    if core_process:
        return AsyncMPEngine.launch(config)
    engine = LLMEngine(config)
    role = serving_role()
    if role == "follower":
        return FollowingHost(lambda: follow(engine))
    server_engine = AsyncLLMEngine(engine)
    if role == "leader":
        lead(engine, on_lost=server_engine.host_lost)
    return server_engine


def main(argv: list[str] | None = None) -> int:
    return run_server(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
