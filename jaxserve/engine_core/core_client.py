"""AsyncMPEngine: the server's engine with its core in a process of its own (vLLM V1's AsyncLLM + EngineCore).

Place in the data flow: the HTTP handlers call `generate`/`abort` as on `AsyncLLMEngine`; this client sends
each request (already tokenized) to the engine core process (`core_process.py`) over a ZeroMQ PUSH socket and
reads every step's outputs from a PULL socket in one asyncio task, which rebuilds what each request asked for
(`output_accumulator.py`) and fans them out to one queue per request. So the HTTP server, JSON and streaming
never hold the core's Python thread, and the core's step never holds theirs.

Start-up: `launch` spawns the core, which loads and warms the model and sends back an `EngineInfo` through a
pipe. Clients that go away abort their requests; aborts arriving together leave in one message. A core that
dies fails every open stream with `EngineDeadError` and makes `is_healthy` false (the server's /health
answers 503); `shutdown` stops it, and a core whose API process is gone stops by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import multiprocessing
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import zmq
import zmq.asyncio

from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineStepError,
    InvalidRequestError,
    OutputObserver,
    settle,
)
from jaxserve.engine.engine_info import EngineInfo
from jaxserve.engine_core import core_messages as msg
from jaxserve.engine_core.core_process import run_engine_core
from jaxserve.engine_core.output_accumulator import CumulativeOutputs, with_prompt
from jaxserve.logger import init_logger
from jaxserve.metrics.stats import StatsSnapshot
from jaxserve.outputs import RequestOutput
from jaxserve.replication.serving_hosts import FollowingHost
from jaxserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

logger = init_logger("jaxserve.engine_core.core_client")

START_POLL_S = 1.0  # how often start-up checks that the core is still alive
SHUTDOWN_GRACE_S = 10.0  # how long a core may take to stop when told to, before it is terminated
_ENGINE_ERRORS = {cls.__name__: cls for cls in (InvalidRequestError, EngineStepError)}  # by the name the core sends


@dataclasses.dataclass
class _Request:
    """A request the core has not finished: kept after its consumer left, until the core reports its end
    (the metrics observer counts what an abort ended)."""

    queue: asyncio.Queue | None  # None: the consumer left
    prompt: str | None
    prompt_token_ids: list[int]
    cumulative: CumulativeOutputs | None  # None: the request gets the core's outputs as they come


@dataclasses.dataclass
class _CoreState:
    """The core's latest stats snapshot and XLA compile count, sent with every output message."""

    stats: StatsSnapshot
    backend_compiles: int


class AsyncMPEngine:
    def __init__(self, process, info: EngineInfo, state: _CoreState, sockets: tuple, socket_dir: Path,
                 observer: OutputObserver | None = None):
        self.process = process
        self.info = info
        self.observer = observer
        self._state = state
        self._context, self._inputs, self._outputs = sockets
        self._socket_dir = socket_dir
        self._requests: dict[str, _Request] = {}
        self._pending_aborts: list[str] = []
        self._calls: dict[int, asyncio.Future] = {}  # engine methods called in the core, by call id
        self._call_ids = itertools.count()
        self._reader: asyncio.Task | None = None
        self._dead: str | None = None
        self._closed = False
        self._stopping = False  # shutdown() or close() was called: the core's exit is expected

    # ----- start and stop -----------------------------------------------------------------------
    @classmethod
    def launch(cls, config: EngineConfig) -> AsyncMPEngine | FollowingHost:
        """Starts the core process and waits until its engine is warm (loading, compiling: minutes). On a host other
        than 0 of a multi-host server, the core follows host 0 and this gives the `FollowingHost` that waits for it."""
        socket_dir = Path(tempfile.mkdtemp(prefix="jaxserve-core-"))
        input_address, output_address = f"ipc://{socket_dir}/input", f"ipc://{socket_dir}/output"
        context = zmq.asyncio.Context()
        inputs, outputs = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        inputs.setsockopt(zmq.SNDHWM, 0)  # never hold a request back: the core takes every message each step
        inputs.bind(input_address)
        outputs.bind(output_address)
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked JAX or threads
        receiver, sender = spawn.Pipe(duplex=False)
        process = spawn.Process(target=run_engine_core, args=(config, input_address, output_address, sender),
                                name="jaxserve-engine-core", daemon=True)
        process.start()
        sender.close()
        try:
            ready = _wait_until_ready(process, receiver)
        except BaseException:
            _stop_process(process, grace=0)
            _close_sockets(context, inputs, outputs, socket_dir)
            raise
        if isinstance(ready, FollowingHost):
            _close_sockets(context, inputs, outputs, socket_dir)
            return ready
        info, state = ready
        logger.info("engine core ready in process %d", process.pid)
        return cls(process, info, state, (context, inputs, outputs), socket_dir)

    async def shutdown(self) -> None:
        self._stopping = True
        if self.process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._inputs.send(msg.encode([msg.SHUTDOWN]), zmq.NOBLOCK)
            await asyncio.get_running_loop().run_in_executor(None, _stop_process, self.process, SHUTDOWN_GRACE_S)
        self.close()

    def close(self) -> None:
        """Stops the core now (no grace) and frees the sockets; for callers without an event loop."""
        if self._closed:
            return
        self._closed = self._stopping = True
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to remove
                asyncio.get_running_loop().remove_reader(self.process.sentinel)
        _stop_process(self.process, grace=0)
        _close_sockets(self._context, self._inputs, self._outputs, self._socket_dir)

    # ----- what the server reads ----------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot serve (its core process exited), or None while it can."""
        if self._dead is None and not self.process.is_alive():
            return _exited(self.process)
        return self._dead

    def make_stats(self) -> StatsSnapshot:
        return self._state.stats

    def backend_compiles(self) -> int:
        return self._state.backend_compiles

    # ----- requests -----------------------------------------------------------------------------
    async def generate(
        self, prompt: dict, sampling_params: SamplingParams | BeamSearchParams | None, request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Streams RequestOutputs for one request until it finishes, as `AsyncLLMEngine.generate` does.
        `prompt`: {"prompt": text, "prompt_token_ids": [...]} (the API process tokenizes)."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = sampling_params or SamplingParams()
        # encoded first: a request that cannot be sent leaves nothing behind
        message = msg.encode([msg.ADD, request_id, prompt, params, priority])
        self._ensure_reader()
        request = _Request(asyncio.Queue(), prompt.get("prompt"), list(prompt["prompt_token_ids"]), None)
        if isinstance(params, SamplingParams) and params.output_kind == RequestOutputKind.CUMULATIVE:
            request.cumulative = CumulativeOutputs(request.prompt, request.prompt_token_ids)
        self._requests[request_id] = request
        if self.observer is not None:
            self.observer.request_arrived(request_id)
        self._inputs.send(message)
        finished = False
        try:
            while not finished:
                item = await request.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            request.queue = None
            if not finished:
                self._request_abort(request_id)

    async def abort(self, request_id: str) -> None:
        self._request_abort(request_id)

    async def reset_prefix_cache(self) -> int:
        """`LLMEngine.reset_prefix_cache` in the core, between two steps; the number of cached blocks dropped."""
        return await self._call_core("reset_prefix_cache")

    async def _call_core(self, method: str):
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        self._ensure_reader()
        call_id = next(self._call_ids)
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self._inputs.send(msg.encode([msg.CALL, call_id, method]))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    def _request_abort(self, request_id: str) -> None:
        """Aborts leave together at the loop's next turn (a disconnect storm is one message)."""
        if not self._pending_aborts:
            asyncio.get_running_loop().call_soon(self._send_aborts)
        self._pending_aborts.append(request_id)

    def _send_aborts(self) -> None:
        aborts, self._pending_aborts = self._pending_aborts, []
        if self._dead is None:
            self._inputs.send(msg.encode([msg.ABORT, aborts]))

    # ----- outputs ------------------------------------------------------------------------------
    def _ensure_reader(self) -> None:
        """One reader task per event loop (a loop that ended took its task with it)."""
        if self._reader is None or self._reader.done():
            loop = asyncio.get_running_loop()
            self._reader = loop.create_task(self._read_outputs())
            loop.add_reader(self.process.sentinel, self._core_exited)

    async def _read_outputs(self) -> None:
        while True:
            message = msg.decode(await self._outputs.recv())
            if message[0] == msg.DEAD:
                self._engine_died(message[1])
                continue
            if message[0] == msg.CALL_RESULT:
                _, call_id, result, error = message
                if call_id in self._calls:
                    settle(self._calls[call_id], result, None if error is None else RuntimeError(error))
                continue
            _, outputs, errors, stats, compiles = message
            self._state = _CoreState(stats, compiles)
            delivered = [(rid, self._rebuild(rid, out)) for rid, out in outputs if rid in self._requests]
            delivered += [(rid, _ENGINE_ERRORS.get(kind, EngineStepError)(text)) for rid, kind, text in errors]
            self._deliver(delivered)

    def _rebuild(self, request_id: str, output: RequestOutput) -> RequestOutput:
        request = self._requests[request_id]
        if request.cumulative is not None:
            return request.cumulative.add(output)
        return with_prompt(output, request.prompt, request.prompt_token_ids)

    def _deliver(self, delivered: list[tuple[str, RequestOutput | BaseException]]) -> None:
        if self.observer is not None:
            self.observer.outputs_delivered(delivered)
        for request_id, item in delivered:
            request = self._requests.get(request_id)
            if request is None:
                continue
            if isinstance(item, BaseException) or item.finished:
                del self._requests[request_id]
            if request.queue is not None:
                request.queue.put_nowait(item)

    def _core_exited(self) -> None:
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        self.process.join(timeout=1)
        self._engine_died(_exited(self.process))

    def _engine_died(self, reason: str) -> None:
        """The first reason stays (the core says why before it exits); open requests fail with it."""
        if self._dead is not None:
            return
        self._dead = reason
        for future in self._calls.values():
            settle(future, None, EngineDeadError(reason))
        if self._stopping:
            return
        logger.error("%s: failing %d open requests", self._dead, len(self._requests))
        self._deliver([(rid, EngineDeadError(self._dead)) for rid in list(self._requests)])


def _exited(process) -> str:
    return f"the engine core process (pid {process.pid}) exited with code {process.exitcode}"


ServerEngine = AsyncLLMEngine | AsyncMPEngine  # what the HTTP server runs on: in-process, or a core process


def _wait_until_ready(process, receiver) -> tuple[EngineInfo, _CoreState] | FollowingHost:
    while not receiver.poll(START_POLL_S):
        if not process.is_alive():
            raise RuntimeError(f"the engine core process exited with code {process.exitcode} while starting")
    try:
        message = receiver.recv()
    except EOFError:
        process.join(timeout=5)
        raise RuntimeError(f"the engine core process exited with code {process.exitcode} while starting") from None
    if message[0] == "follower":  # multi-host: the core makes host 0's device calls until host 0 stops
        return FollowingHost(lambda: _exit_status(process))
    if message[0] != "ready":
        raise RuntimeError(f"the engine core failed to start: {message[1]}")
    _, info, stats, compiles = message
    return info, _CoreState(stats, compiles)


def _exit_status(process) -> int:
    process.join()
    return process.exitcode


def _stop_process(process, grace: float) -> None:
    process.join(timeout=grace)
    if process.is_alive():
        process.terminate()
        process.join(timeout=5)
    if process.is_alive():
        process.kill()
        process.join()


def _close_sockets(context, inputs, outputs, socket_dir: Path) -> None:
    inputs.close(linger=0)
    outputs.close(linger=0)
    context.term()
    shutil.rmtree(socket_dir, ignore_errors=True)
