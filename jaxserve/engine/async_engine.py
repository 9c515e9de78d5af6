"""AsyncLLMEngine: the server's engine. A background task drives LLMEngine.step() in a worker thread
and fans the outputs out to one asyncio queue per request.

Adds and aborts are queued and applied by the worker between steps, so the engine is only ever touched
from one thread. An error while adding a request reaches that request's stream, not the loop;
cancelling a consumer (client disconnect) aborts its request and frees its blocks. An optional
observer (the server's `ServingMetrics`) hears of each arrival and of every delivered output.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Protocol

from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.engine_info import EngineInfo
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.logger import init_logger
from jaxserve.metrics.stats import StatsSnapshot
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import BeamSearchParams, SamplingParams

logger = init_logger("jaxserve.engine.async_engine")


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more (its core process exited, a host of a multi-host server was lost): the
    server answers 503, as vLLM."""

    status = HTTPStatus.SERVICE_UNAVAILABLE


class InvalidRequestError(ValueError):
    """The engine refused a request for what it asks (its checks in `LLMEngine.add_request`): the client's fault,
    which the server answers 400. Every other error of the engine is the server's (500)."""

    status = HTTPStatus.BAD_REQUEST


class EngineStepError(RuntimeError):
    """An engine step failed (a bug, not the request's fault): the requests it ran fail with this and the server
    answers 500 (in a stream: an error event, then `[DONE]`); the engine goes on serving."""

    status = HTTPStatus.INTERNAL_SERVER_ERROR


def as_request_error(err: Exception) -> Exception:
    """What an error of `LLMEngine.add_request` means to the client: its checks raise ValueError or TypeError (the
    request's fault); anything else is the engine's."""
    if isinstance(err, (ValueError, TypeError)) and not isinstance(err, InvalidRequestError):
        return InvalidRequestError(str(err))
    return err


class OutputObserver(Protocol):
    def request_arrived(self, request_id: str) -> None: ...

    def outputs_delivered(self, delivered: list[tuple[str, RequestOutput | BaseException]]) -> None: ...


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, observer: OutputObserver | None = None):
        self.engine = engine
        self.info = EngineInfo.of(engine)
        self.observer = observer
        self._streams: dict[str, asyncio.Queue] = {}
        self._pending_adds: collections.deque = collections.deque()
        self._pending_aborts: collections.deque = collections.deque()
        self._pending_calls: collections.deque = collections.deque()  # (engine method, future) run between steps
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxserve-step")
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(LLMEngine(config))

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    @property
    def is_healthy(self) -> bool:
        """False once the step loop ended by itself (it only ends on a bug outside a step)."""
        return self.dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot serve (a lost host, the step loop's error), or None while it can."""
        host = self.engine.leading_host
        if host is not None and host.lost is not None:
            return host.lost
        task = self._loop_task
        if task is None or not task.done() or task.cancelled():
            return None
        return f"the engine's step loop ended: {task.exception()!r}"

    def make_stats(self) -> StatsSnapshot:
        return self.engine.make_stats()

    def backend_compiles(self) -> int:
        return self.engine.serving_compiles()

    def _ensure_loop(self) -> None:
        if not self.is_running:
            self._wakeup = asyncio.Event()
            self._event_loop = asyncio.get_running_loop()
            self._loop_task = self._event_loop.create_task(self._run_loop())

    def host_lost(self, reason: str) -> None:
        """Multi-host serving lost a host (called from the heartbeat thread): every open stream fails with the
        reason; `dead_reason` already gives it to /health."""
        if self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(self._fail_streams, reason)

    def _fail_streams(self, reason: str) -> None:
        for queue in self._streams.values():
            queue.put_nowait(EngineDeadError(reason))

    async def generate(
        self, prompt, sampling_params: SamplingParams | BeamSearchParams | None, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Streams RequestOutputs for one request until it finishes (a beam search: only its final output)."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._ensure_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        if self.observer is not None:
            self.observer.request_arrived(request_id)
        self._pending_adds.append((request_id, prompt, sampling_params or SamplingParams(), priority))
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._request_abort(request_id)

    async def abort(self, request_id: str) -> None:
        self._request_abort(request_id)

    async def reset_prefix_cache(self) -> int:
        """`LLMEngine.reset_prefix_cache`, between two steps; the number of cached blocks dropped."""
        self._ensure_loop()
        future = asyncio.get_running_loop().create_future()
        self._pending_calls.append((self.engine.reset_prefix_cache, future))
        self._wakeup.set()
        return await future

    def _request_abort(self, request_id: str) -> None:
        self._pending_aborts.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self._pending_adds or self._pending_aborts or self._pending_calls
                    or self.engine.has_unfinished_requests()):
                self._wakeup.clear()
                await self._wakeup.wait()
            try:
                delivered = await loop.run_in_executor(self._executor, self._step_once)
            except Exception as err:  # a bug in a step: fail the running requests, keep serving
                logger.exception("engine step failed")
                failure = EngineStepError(f"engine step failed: {err!r}")
                delivered = [(rid, failure) for rid in self.engine.abort_all_requests()]
            if self.observer is not None:
                self.observer.outputs_delivered(delivered)
            for request_id, item in delivered:
                queue = self._streams.get(request_id)
                if queue is not None:
                    queue.put_nowait(item)

    def _step_once(self) -> list[tuple[str, RequestOutput | BaseException]]:
        """Runs in the worker thread: apply adds and aborts, then one engine step."""
        delivered: list = []
        while self._pending_adds:  # adds first: an abort queued with its own add must find the request
            request_id, prompt, params, priority = self._pending_adds.popleft()
            try:
                self.engine.add_request(request_id, prompt, params, priority)
            except Exception as err:
                delivered.append((request_id, as_request_error(err)))
        while self._pending_aborts:
            request_id = self._pending_aborts.popleft()
            aborted = self.engine.abort_request(request_id)
            if aborted is not None:
                delivered.append((request_id, aborted))
        while self._pending_calls:
            method, future = self._pending_calls.popleft()
            _settle_from_thread(future, method)
        if self.engine.has_unfinished_requests():
            delivered += [(out.request_id, out) for out in self.engine.step()]
        return delivered

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.close()

    def close(self) -> None:
        """Stops the followers of a multi-host server, and the engine's KV event publisher."""
        if self.engine.leading_host is not None:
            self.engine.leading_host.stop()
        self.engine.close()


def _settle_from_thread(future: asyncio.Future, method) -> None:
    """Runs ``method`` here (the engine's thread) and hands its result or error to ``future``'s loop."""
    try:
        outcome = (method(), None)
    except Exception as err:
        outcome = (None, err)
    future.get_loop().call_soon_threadsafe(settle, future, *outcome)


def settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    """``future`` gets ``error`` if given, else ``result``; nothing if its caller stopped waiting."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
