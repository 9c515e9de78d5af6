"""KV cache events for KV-aware routers: the blocks the prefix cache stores and evicts, published over ZeroMQ in
vLLM's format (`kv_events_config`), so that vLLM's router (`vllm-router --policy kv_aware`) sends a request to
the replica that holds its prefix.

Place in the data flow: the `BlockManager`'s prefix cache records a `BlockStored` when it registers a block's hash
and a `BlockRemoved` when it evicts one; after each step the engine hands the recorded events to the
`KVEventPublisher`, whose thread sends them as one batch.

Wire format (vLLM's `vllm/engine/kv_events.py`, as vllm-router 0.1.17 decodes it): three frames, [topic,
sequence number (8 bytes, big-endian, from 0), msgpack payload]; the payload is [timestamp, events, data-parallel
rank] and each event a map with a "type" key and vLLM's fields. Block hashes are the low 64 bits of jaxserve's
SHA-256 block hashes (what vLLM sends by default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1); a prompt's first block
has no parent. With a `replay_endpoint`, a ROUTER socket resends the last `buffer_steps` batches from a requested
sequence number: request [client, b"", start (8 bytes)], replies [client, b"", topic, seq, payload], ended by
sequence number -1 and an empty payload.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Any

import msgpack
import zmq

from jaxserve.config.kv_events_config import KVEventsConfig
from jaxserve.core.prefix_cache import AllBlocksCleared, BlocksRemoved, BlocksStored
from jaxserve.logger import init_logger

logger = init_logger(__name__)

MEDIUM = "GPU"  # vLLM's name for the accelerator's memory, the only tier jaxserve caches in
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
REPLAY_POLL_S = 0.01  # with a replay endpoint, how often the publisher thread looks for replay requests


def external_hash(block_hash: bytes) -> int:
    """The 64-bit integer a router keys a block by: the low 64 bits of its hash, as vLLM sends them."""
    return int.from_bytes(block_hash, "big") & (2**64 - 1)


def block_stored(block_hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int) -> dict:
    """A `BlockStored` event: full blocks of ``block_size`` tokens, their hashes in order, the first one's parent."""
    if len(token_ids) != len(block_hashes) * block_size:
        raise ValueError(f"BlockStored of {len(block_hashes)} blocks of {block_size} tokens has "
                         f"{len(token_ids)} tokens")
    return {"type": "BlockStored", "block_hashes": [external_hash(h) for h in block_hashes],
            "parent_block_hash": None if parent is None else external_hash(parent), "token_ids": list(token_ids),
            "block_size": block_size, "lora_id": None, "medium": MEDIUM, "lora_name": None}


def block_removed(block_hashes: list[bytes]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": [external_hash(h) for h in block_hashes], "medium": MEDIUM}


def all_blocks_cleared() -> dict:
    return {"type": "AllBlocksCleared"}


def wire_event(event: BlocksStored | BlocksRemoved | AllBlocksCleared, block_size: int) -> dict:
    """The event a router reads for a prefix-cache record of the `BlockManager`."""
    if isinstance(event, BlocksStored):
        return block_stored(event.block_hashes, event.parent, event.token_ids, block_size)
    if isinstance(event, AllBlocksCleared):
        return all_blocks_cleared()
    return block_removed(event.block_hashes)


def encode_batch(events: list[dict], timestamp: float, data_parallel_rank: int | None = None) -> bytes:
    return msgpack.packb([timestamp, events, data_parallel_rank])


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host (or an ipc/inproc endpoint) is bound, anything else connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Sends each `publish` call's events as one batch from its own thread (the step never waits on a socket)."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None,
                 context: zmq.Context | None = None) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._context = context or zmq.Context.instance()
        self._queue: queue.Queue[tuple[float, list[dict]] | None] = queue.Queue(config.max_queue_size)
        self._sent: deque[tuple[bytes, bytes]] = deque(maxlen=config.buffer_steps)  # (seq, payload) for replay
        self._topic = config.topic.encode()
        self._pub = self._socket(zmq.PUB, config.endpoint)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._replay = None if config.replay_endpoint is None else self._socket(zmq.ROUTER, config.replay_endpoint)
        self.num_dropped = 0  # batches dropped because the queue was full
        self._thread = threading.Thread(target=self._run, name="jaxserve-kv-events", daemon=True)
        self._thread.start()

    def _socket(self, kind: int, endpoint: str) -> zmq.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        (socket.bind if binds(endpoint) else socket.connect)(endpoint)
        return socket

    def endpoint(self) -> str:
        """The PUB socket's address (the port a ``tcp://*:0`` endpoint was given)."""
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    def replay_address(self) -> str | None:
        return None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def sources(self) -> dict[str, Any]:
        """`GET /kv_event_sources`, vLLM's answer: where each data-parallel rank publishes, for vllm-router to
        discover (its endpoint as bound: a ``tcp://*:0`` endpoint's port is the one the system chose)."""
        config = self.config
        return {str(self.data_parallel_rank or 0): {
            "endpoint": _with_wildcard_host(self.endpoint(), config.endpoint),
            "replay_endpoint": None if self._replay is None else _with_wildcard_host(self.replay_address(),
                                                                                      config.replay_endpoint),
            "topic": config.topic, "hwm": config.hwm, "buffer_steps": config.buffer_steps, "publisher": "zmq",
            "encoding": "msgpack", "schema_version": 1, "enable_kv_cache_events": True,
        }}

    def publish(self, events: list[dict]) -> None:
        """Queues one batch (nothing when ``events`` is empty); a full queue drops it and counts the drop."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            logger.warning("KV events queue full (%d batches): a batch of %d events dropped",
                           self.config.max_queue_size, len(events))

    def close(self, timeout: float = 5.0) -> None:
        """Sends what is queued, then closes the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        sequence = 0
        try:
            while True:
                if self._replay is not None and poller.poll(0):
                    self._answer_replay()
                try:  # without a replay socket to answer, the thread sleeps until a batch comes
                    item = self._queue.get(timeout=REPLAY_POLL_S if self._replay is not None else None)
                except queue.Empty:
                    continue
                if item is None:
                    return
                seq = sequence.to_bytes(8, "big")
                payload = encode_batch(item[1], item[0], self.data_parallel_rank)
                self._pub.send_multipart((self._topic, seq, payload))
                self._sent.append((seq, payload))
                sequence += 1
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()

    def _answer_replay(self) -> None:
        client, _, start = self._replay.recv_multipart()
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._sent):
            if int.from_bytes(seq, "big") >= first:
                self._replay.send_multipart((client, b"", self._topic, seq, payload))
        self._replay.send_multipart((client, b"", self._topic, END_OF_REPLAY, b""))


def _with_wildcard_host(bound: str, configured: str) -> str:
    """The bound address (``tcp://0.0.0.0:5557``) written with the configured wildcard (``tcp://*:5557``), which a
    router replaces by the worker's host."""
    if "*" not in configured.rsplit(":", 1)[0]:
        return bound
    return "tcp://*:" + bound.rsplit(":", 1)[1]
