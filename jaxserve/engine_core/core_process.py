"""The engine core process: an `LLMEngine` stepping in a process of its own, fed over ZeroMQ.

Place in the data flow: `core_client.py` starts this process with the `EngineConfig` and two socket
addresses. It builds and warms the engine, sends an `EngineInfo` (tokenizer, limits, grid) back through
the start-up pipe, then loops: take every request, abort and shutdown message waiting (block while it has
nothing to run), apply them, run one `LLMEngine.step()`, and send that step's outputs with a stats snapshot
in one message (`core_messages.py`). The scheduler, the device steps, detokenization and stop conditions
run here; the HTTP server, tokenization, chat templates and streaming in the API process.

Outputs travel as deltas (only what is new since the last one) and without the prompt, which the client
already holds; the client rebuilds what the request asked for. A failed step fails the requests it ran
and the core goes on. The core exits when told to, or on its own when the API process is gone.
"""

from __future__ import annotations

import dataclasses
import os
import traceback

import jax
import zmq

from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.async_engine import EngineStepError, as_request_error
from jaxserve.engine.engine_info import EngineInfo
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine_core import core_messages as msg
from jaxserve.logger import init_logger
from jaxserve.outputs import RequestOutput
from jaxserve.replication.serving_hosts import follow, lead, serving_role
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger("jaxserve.engine_core.core_process")

IDLE_POLL_MS = 1000  # while idle, how often the core checks that the API process is still there


def run_engine_core(config: EngineConfig, input_address: str, output_address: str, ready_pipe) -> None:
    """The core process's entry point (a spawned process's target)."""
    parent = os.getppid()
    try:
        engine = LLMEngine(config)
    except BaseException as err:
        ready_pipe.send(("failed", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        raise
    role = serving_role()
    if role == "follower":  # multi-host: this host makes host 0's device calls, its API process serves nothing
        ready_pipe.send(("follower", jax.process_index()))
        ready_pipe.close()
        follow(engine)
        return
    core = EngineCore(engine, input_address, output_address, parent)
    if role == "leader":
        lead(engine, on_lost=core.report_dead)
    ready_pipe.send(("ready", EngineInfo.of(engine), engine.make_stats(), engine.serving_compiles()))
    ready_pipe.close()
    core.run()


class EngineCore:
    def __init__(self, engine: LLMEngine, input_address: str, output_address: str, parent_pid: int):
        self.engine = engine
        self.parent_pid = parent_pid
        self.context = zmq.Context()
        self.inputs = self.context.socket(zmq.PULL)
        self.inputs.connect(input_address)
        self.outputs = self.context.socket(zmq.PUSH)
        self.outputs.connect(output_address)
        self.output_address = output_address
        self.running = True

    def run(self) -> None:
        try:
            while self.running:
                delivered, errors = self._apply(self._receive(block=not self.engine.has_unfinished_requests()))
                if self.running and self.engine.has_unfinished_requests():
                    step_outputs, step_errors = self._step()
                    delivered += step_outputs
                    errors += step_errors
                if delivered or errors:
                    self._send(delivered, errors)
        finally:
            if self.engine.leading_host is not None:
                self.engine.leading_host.stop()
            self.engine.close()
            self.inputs.close(linger=0)
            self.outputs.close(linger=1000)
            self.context.term()

    def _receive(self, block: bool) -> list:
        """Every message waiting; while idle, waits for one. Checks each time that the API process lives (busy,
        the core would otherwise step on for nobody until its output socket filled up, then hang)."""
        while True:
            if os.getppid() != self.parent_pid:
                logger.warning("the API process is gone: the engine core exits")
                return [[msg.SHUTDOWN]]
            if not block or self.inputs.poll(IDLE_POLL_MS):
                break
        messages = []
        while True:
            try:
                messages.append(msg.decode(self.inputs.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return messages

    def _apply(self, messages: list) -> tuple[list, list]:
        """Adds first, then aborts (an abort sent right after its add must find the request)."""
        delivered, errors = [], []
        for message in messages:
            if message[0] == msg.ADD:
                _, request_id, prompt, params, priority = message
                try:
                    self.engine.add_request(request_id, prompt, as_delta(params), priority)
                except Exception as err:
                    failure = as_request_error(err)
                    errors.append([request_id, type(failure).__name__, str(failure)])
            elif message[0] == msg.SHUTDOWN:
                self.running = False
            elif message[0] == msg.CALL:
                self._call(*message[1:])
        for message in messages:
            if message[0] == msg.ABORT:
                for request_id in message[1]:
                    output = self.engine.abort_request(request_id)
                    if output is not None:
                        delivered.append(output)
        return delivered, errors

    def _call(self, call_id: int, method: str) -> None:
        """An engine method the API process asked for; its result goes back at once."""
        try:
            if method not in msg.CALLABLE:
                raise ValueError(f"the engine core does not run {method!r}")
            result, error = getattr(self.engine, method)(), None
        except Exception as err:
            result, error = None, f"{type(err).__name__}: {err}"
        self.outputs.send(msg.encode([msg.CALL_RESULT, call_id, result, error]))

    def _step(self) -> tuple[list, list]:
        try:
            return self.engine.step(), []
        except Exception as err:  # a bug in a step: fail the running requests, keep serving
            logger.exception("engine step failed")
            failed = self.engine.abort_all_requests()
            return [], [[request_id, EngineStepError.__name__, f"engine step failed: {err!r}"] for request_id in failed]

    def report_dead(self, reason: str) -> None:
        """Tells the API process why the engine cannot go on (a lost host), from any thread: a socket of its own."""
        sock = self.context.socket(zmq.PUSH)
        sock.connect(self.output_address)
        sock.send(msg.encode([msg.DEAD, reason]))
        sock.close(linger=1000)

    def _send(self, delivered: list[RequestOutput], errors: list) -> None:
        outputs = [[out.request_id, without_prompt(out)] for out in delivered]
        stats, compiles = self.engine.make_stats(), self.engine.serving_compiles()
        self.outputs.send(msg.encode([msg.OUTPUTS, outputs, errors, stats, compiles]))


def as_delta(params):
    """Cumulative outputs become deltas on the wire (the client adds them up again); final-only stays."""
    if isinstance(params, SamplingParams) and params.output_kind == RequestOutputKind.CUMULATIVE:
        return dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    return params


def without_prompt(output: RequestOutput) -> RequestOutput:
    return dataclasses.replace(output, prompt=None, prompt_token_ids=[])
