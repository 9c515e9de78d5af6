"""Multi-host serving: host 0 serves HTTP and schedules; every other host replays host 0's runner calls on its
own engine, so each SPMD step runs on every host's devices with the same inputs.

Place in the data flow: the server (`api_server.start_engine`, or the engine core process) builds its engine as
usual, every host alike (with `--distributed-init` the engine joins `jax.distributed` first and its mesh spans
all hosts), then calls `serving_role`. Alone it serves as ever. On host 0, `lead` wraps the engine's runners
(the target's, a draft model's) in `ReplicatedRunner`s: each device call (`execute`, `resample`,
`copy_blocks`, `write_slot`, and the fork programs' compile) is sent to the followers
(`step_messages.py`, `host_links.py`) before host 0 makes it. On any other host, `follow` makes the same calls
in the same order until host 0 stops, and then the process exits: followers serve no HTTP, and their
schedulers never run (a scheduler's choices depend on timings, which differ between hosts).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
from jax._src import distributed as jax_distributed

from jaxserve.distributed.host_links import FollowerLinks, LeaderLinks, host_name
from jaxserve.logger import init_logger
from jaxserve.replication import step_messages
from jaxserve.speculative.draft_model import DraftModelProposer

logger = init_logger("jaxserve.replication.serving_hosts")

REPLAYED = frozenset({"execute", "resample", "copy_blocks", "write_slot", "compile_helpers"})


def serving_role() -> str:
    """"single" (one process), "leader" (process 0 of several) or "follower"."""
    if jax.process_count() == 1:
        return "single"
    return "leader" if jax.process_index() == 0 else "follower"


def engine_runners(engine) -> dict:
    """The runners whose calls reach the devices, by the name they travel under."""
    runners = {"target": engine.runner}
    if isinstance(engine.proposer, DraftModelProposer):
        runners["draft"] = engine.proposer.runner
    return runners


@dataclasses.dataclass
class BroadcastStats:
    """What replication cost host 0: calls sent, their bytes and the seconds spent encoding and sending them."""

    num_calls: int
    num_bytes: int
    seconds: float


@dataclasses.dataclass
class FollowingHost:
    """What a server becomes on a host other than 0: no HTTP; `run` follows host 0 until it stops and gives the
    process's exit status."""

    run: Callable[[], int]


class LeadingHost:
    """Host 0's end: sends each runner call before making it; `stop` ends the followers. `on_lost` hears, from the
    heartbeat thread, why serving stopped (a host was lost) before the process exits."""

    def __init__(self, kv_client, leader_host: str, num_processes: int, on_lost: Callable[[str], None] | None):
        self.lost: str | None = None
        self._on_lost = on_lost
        self.links = LeaderLinks(kv_client, leader_host, num_processes, self._host_lost)
        self.handles = step_messages.OutputHandles()
        self.encode_seconds = 0.0

    def _host_lost(self, reason: str) -> None:
        self.lost = reason
        if self._on_lost is not None:
            self._on_lost(reason)

    def call(self, runner_name: str, runner, method: str, args: tuple):
        started = time.perf_counter()
        payload = step_messages.encode([runner_name, method, list(args)], self.handles)
        self.encode_seconds += time.perf_counter() - started
        self.links.send(payload)
        return self.handles.add(getattr(runner, method)(*args))

    def stats(self) -> BroadcastStats:
        return BroadcastStats(self.links.num_messages, self.links.num_bytes,
                              self.encode_seconds + self.links.send_seconds)

    def stop(self) -> None:
        """Tells the followers to stop, then leaves `jax.distributed` with them (its shutdown waits for every
        process: host 0 runs the coordinator, which must outlive the others' last call)."""
        if not self.links.stopped:
            self.links.stop()
            jax.distributed.shutdown()


class ReplicatedRunner:
    """A runner on host 0 whose device calls the followers make too; everything else is the runner's own."""

    def __init__(self, name: str, runner, host: LeadingHost):
        self._name, self._runner, self._host = name, runner, host

    def __getattr__(self, attr: str):
        value = getattr(self._runner, attr)
        if attr not in REPLAYED:
            return value
        return lambda *args: self._host.call(self._name, self._runner, attr, args)


def lead(engine, kv_client=None, on_lost: Callable[[str], None] | None = None) -> LeadingHost:
    """Host 0: opens the links, waits for every follower, then replicates the engine's runner calls."""
    leader_host = jax_distributed.global_state.coordinator_address.rsplit(":", 1)[0]  # process 0 coordinates
    host = LeadingHost(kv_client or _kv_client(), leader_host, jax.process_count(), on_lost)
    host.links.join()
    engine.step_runner.model = ReplicatedRunner("target", engine.step_runner.model, host)
    if isinstance(engine.proposer, DraftModelProposer):
        engine.proposer.runner = ReplicatedRunner("draft", engine.proposer.runner, host)
    engine.leading_host = host
    return host


def follow(engine, kv_client=None) -> int:
    """Any other host: makes host 0's calls on this engine's runners until host 0 stops; the exit status, 0 (a
    failure exits the process from the beat thread, `host_links.py`)."""
    links = FollowerLinks(kv_client or _kv_client(), jax.process_index())
    links.join()
    logger.info("%s follows host 0's steps (no HTTP server here)", host_name(jax.process_index()))
    runners, handles, num_calls = engine_runners(engine), step_messages.OutputHandles(), 0
    while (payload := links.receive()) is not None:
        try:
            runner_name, method, args = step_messages.decode(payload, handles)
            if method not in REPLAYED:
                raise ValueError(f"host 0 sent an unknown runner call {method!r}")
            handles.add(getattr(runners[runner_name], method)(*args))
        except Exception as err:
            logger.exception("replaying host 0's call failed")
            links.fail(f"{type(err).__name__}: {err}")
            while True:  # the beat thread tells host 0, then exits the process
                time.sleep(1)
        num_calls += 1
    logger.info("host 0 stopped serving after %d calls: this host stops too", num_calls)
    jax.distributed.shutdown()  # with host 0, which waits for it
    return 0


def _kv_client():
    client = jax_distributed.global_state.client
    if client is None:
        raise RuntimeError("multi-host serving needs jax.distributed: start every host with --distributed-init")
    return client
