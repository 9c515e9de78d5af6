"""The links between the hosts of a multi-host server: host 0 (the leader) publishes its runner calls, every
host beats, and a host that goes silent ends every process loudly, never a hang.

Place in the data flow: `replication/serving_hosts.py` opens a `LeaderLinks` on host 0 and a `FollowerLinks` on
every other host once their engines are warm. Host 0 publishes its addresses in `jax.distributed`'s key-value store
(the coordinator every host already joined), so the followers need no configuration of their own.

ZeroMQ over TCP, host 0 binding:
    commands  PUB  -> each follower's SUB    [kind, payload]: "hello" until they join, runner calls, "stop"
    beats     PUB  -> each follower's SUB    host 0's heartbeat; "lost" when a host is lost
    replies   PULL <- each follower's PUSH   "joined", heartbeats, "failed" (a follower's replay raised)
Every host beats each `HEARTBEAT_S`; one silent for `host_timeout_s` (`JAXSERVE_HOST_TIMEOUT_S`, default
`HOST_TIMEOUT_S`) is lost. Host 0 then calls its `on_lost` (the server answers 503 naming the host), tells the
followers, and exits with status 1 after `LOST_EXIT_GRACE_S`; a follower that loses host 0, or hears that a
host was lost, exits with status 1 naming it. The beating runs in threads of their own, so a process blocked in
a collective with a dead peer still exits.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable

import msgpack
import zmq

from jaxserve.logger import init_logger

logger = init_logger("jaxserve.distributed.host_links")

HEARTBEAT_S = 1.0
HOST_TIMEOUT_S = 10.0
TIMEOUT_ENV = "JAXSERVE_HOST_TIMEOUT_S"
JOIN_TIMEOUT_S = 300.0  # how long host 0 waits for every follower to open its links (their warm-ups differ)
LOST_EXIT_GRACE_S = 2.0  # how long host 0 answers 503 with the reason before it exits
ADDRESS_KEY = "jaxserve/serving_hosts/leader"
JOINED, BEAT, LOST, FAILED = "joined", "beat", "lost", "failed"
HELLO, CALL, STOP = b"hello", b"call", b"stop"  # the kinds of commands


def host_timeout_s() -> float:
    value = os.environ.get(TIMEOUT_ENV)
    if not value:
        return HOST_TIMEOUT_S
    try:
        timeout = float(value)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {value!r}") from None
    if timeout <= HEARTBEAT_S:
        raise ValueError(f"{TIMEOUT_ENV} must exceed the heartbeat ({HEARTBEAT_S}s), got {value!r}")
    return timeout


def host_name(process_index: int) -> str:
    return "host 0 (process 0, the server)" if process_index == 0 else f"host {process_index} (process {process_index})"


def _pack(*message) -> bytes:
    return msgpack.packb(list(message))


def _exit_loudly(message: str) -> None:
    logger.error("%s: this process exits", message)
    os._exit(1)  # threads may be blocked in a collective with the lost host: nothing else would end them


class LeaderLinks:
    """Host 0's side: `send` publishes a runner call to every follower."""

    def __init__(self, kv_client, leader_host: str, num_processes: int, on_lost: Callable[[str], None]):
        self.followers = list(range(1, num_processes))
        self.timeout_s = host_timeout_s()
        self.on_lost = on_lost
        self.context = zmq.Context()
        self.commands = self.context.socket(zmq.PUB)
        self.commands.setsockopt(zmq.SNDHWM, 0)  # never drop a call: a follower that fell behind catches up
        self._beats = self.context.socket(zmq.PUB)
        self._replies = self.context.socket(zmq.PULL)
        ports = [sock.bind_to_random_port("tcp://*") for sock in (self.commands, self._beats, self._replies)]
        kv_client.key_value_set(ADDRESS_KEY, json.dumps([f"tcp://{leader_host}:{port}" for port in ports]))
        self._lock = threading.Lock()  # the step thread sends calls, the server's thread "stop"
        self._stopped = threading.Event()
        self.num_messages = self.num_bytes = 0
        self.send_seconds = 0.0

    def join(self) -> None:
        """Waits until every follower receives the commands (a PUB drops what it sends before they subscribe),
        then starts the heartbeat thread."""
        joined, deadline = set(), time.monotonic() + JOIN_TIMEOUT_S
        while joined != set(self.followers):
            if time.monotonic() > deadline:
                missing = ", ".join(host_name(i) for i in self.followers if i not in joined)
                raise RuntimeError(f"multi-host serving: {missing} did not join within {JOIN_TIMEOUT_S:.0f}s")
            self.commands.send_multipart([HELLO, b""])
            while self._replies.poll(100):
                kind, index, *_ = msgpack.unpackb(self._replies.recv())
                if kind == JOINED:
                    joined.add(index)
        logger.info("multi-host serving: %d followers joined; host timeout %.0fs", len(self.followers),
                    self.timeout_s)
        threading.Thread(target=self._beat, name="jaxserve-host-beats", daemon=True).start()

    def send(self, payload: bytes) -> None:
        started = time.perf_counter()
        with self._lock:
            self.commands.send_multipart([CALL, payload])
        self.send_seconds += time.perf_counter() - started
        self.num_messages += 1
        self.num_bytes += len(payload)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def stop(self) -> None:
        """A clean shutdown: the followers finish the calls before it and exit with status 0."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        with self._lock:
            self.commands.send_multipart([STOP, b""])
            self.commands.close(linger=int(1000 * HEARTBEAT_S))

    def _beat(self) -> None:
        last_heard = dict.fromkeys(self.followers, time.monotonic())
        while not self._stopped.is_set():
            self._beats.send(_pack(BEAT, 0))
            if self._replies.poll(int(1000 * HEARTBEAT_S)):
                kind, index, *detail = msgpack.unpackb(self._replies.recv())
                last_heard[index] = time.monotonic()
                if kind == FAILED:
                    self._lost(f"{host_name(index)} failed: {detail[0]}")
            now = time.monotonic()
            for index, heard in last_heard.items():
                if now - heard > self.timeout_s and not self._stopped.is_set():
                    self._lost(f"{host_name(index)} has not been heard from for {now - heard:.1f}s")

    def _lost(self, reason: str) -> None:
        message = f"multi-host serving stopped: {reason}"
        logger.error("%s; every host exits", message)
        self._beats.send(_pack(LOST, message))
        self.on_lost(message)
        time.sleep(LOST_EXIT_GRACE_S)
        _exit_loudly(message)


class FollowerLinks:
    """A follower's side: `receive` gives host 0's calls in order (None after "stop")."""

    def __init__(self, kv_client, process_index: int):
        self.index = process_index
        self.timeout_s = host_timeout_s()
        commands, beats, replies = json.loads(kv_client.blocking_key_value_get(ADDRESS_KEY, int(1000 * JOIN_TIMEOUT_S)))
        self.context = zmq.Context()
        self.commands = self._subscriber(commands)
        self._beats = self._subscriber(beats)
        self._replies = self.context.socket(zmq.PUSH)
        self._replies.connect(replies)
        self._failure: str | None = None

    def _subscriber(self, address: str) -> zmq.Socket:
        sock = self.context.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(address)
        return sock

    def join(self) -> None:
        """Answers host 0's first hello, then beats in a thread of its own."""
        while self.commands.recv_multipart()[0] != HELLO:
            pass
        self._replies.send(_pack(JOINED, self.index))
        threading.Thread(target=self._beat, name="jaxserve-host-beats", daemon=True).start()

    def receive(self) -> bytes | None:
        while True:
            kind, payload = self.commands.recv_multipart()
            if kind == CALL:
                return payload
            if kind == STOP:
                return None

    def fail(self, reason: str) -> None:
        """A replayed call raised: host 0 hears why, then every host exits."""
        self._failure = reason

    def _beat(self) -> None:
        last_heard = time.monotonic()
        while True:
            if self._failure is not None:
                self._replies.send(_pack(FAILED, self.index, self._failure))
                time.sleep(HEARTBEAT_S)
                _exit_loudly(f"{host_name(self.index)} failed: {self._failure}")
            self._replies.send(_pack(BEAT, self.index))
            deadline = time.monotonic() + HEARTBEAT_S
            while (wait := deadline - time.monotonic()) > 0 and self._beats.poll(int(1000 * wait)):
                kind, detail = msgpack.unpackb(self._beats.recv())
                if kind == LOST:
                    _exit_loudly(detail)
                last_heard = time.monotonic()
            if time.monotonic() - last_heard > self.timeout_s:
                _exit_loudly(f"multi-host serving stopped: {host_name(0)} has not been heard from for "
                             f"{time.monotonic() - last_heard:.1f}s")
