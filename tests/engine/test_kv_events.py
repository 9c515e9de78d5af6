"""KV cache events in vLLM's wire format (`jaxserve/engine/kv_events.py`): the config's keys and errors, the
events' exact fields, the publisher's three frames and sequence numbers, and the replay socket."""

from __future__ import annotations

import hashlib

import msgpack
import pytest
import zmq

from jaxserve.config.kv_events_config import KVEventsConfig
from jaxserve.engine.kv_events import (
    END_OF_REPLAY,
    KVEventPublisher,
    all_blocks_cleared,
    block_removed,
    block_stored,
    external_hash,
)

HASHES = [hashlib.sha256(bytes([i])).digest() for i in range(3)]


def test_config_takes_vllms_keys_and_defaults():
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}')
    assert config == KVEventsConfig(True, None, "tcp://*:6000", None, 10_000, 100_000, 100_000, "kv")
    assert config.publishes
    assert not KVEventsConfig().publishes
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").publishes
    assert KVEventsConfig.parse(None) is None


@pytest.mark.parametrize(("value", "message"), [
    ({"enable_kv_cache_events": True, "port": 5}, "kv_events_config: unknown key(s) 'port'; known: "
     "enable_kv_cache_events, publisher, endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic"),
    ({"publisher": "nats"}, "kv_events_config: publisher must be 'zmq' or 'null', got 'nats'"),
    ({"buffer_steps": 0}, "kv_events_config: buffer_steps must be a positive integer, got 0"),
    ({"enable_kv_cache_events": "yes"}, "kv_events_config: enable_kv_cache_events must be true or false, got 'yes'"),
    ("[1]", "kv_events_config must be a dict or a JSON object, got list"),
    ("{", "kv_events_config: not a JSON object: Expecting property name enclosed in double quotes: line 1 column 2 "
     "(char 1)"),
])
def test_bad_configs_name_the_problem(value, message):
    with pytest.raises(ValueError) as info:
        KVEventsConfig.parse(value)
    assert str(info.value) == message


def test_events_carry_exactly_vllms_fields():
    stored = block_stored(HASHES[1:], HASHES[0], list(range(8)), 4)
    assert stored == {"type": "BlockStored", "block_hashes": [external_hash(HASHES[1]), external_hash(HASHES[2])],
                      "parent_block_hash": external_hash(HASHES[0]), "token_ids": list(range(8)), "block_size": 4,
                      "lora_id": None, "medium": "GPU", "lora_name": None}
    assert external_hash(HASHES[0]) == int.from_bytes(HASHES[0][-8:], "big")
    assert block_stored(HASHES[:1], None, [1, 2, 3, 4], 4)["parent_block_hash"] is None
    assert block_removed(HASHES[:1]) == {"type": "BlockRemoved", "block_hashes": [external_hash(HASHES[0])],
                                         "medium": "GPU"}
    assert all_blocks_cleared() == {"type": "AllBlocksCleared"}
    with pytest.raises(ValueError, match="BlockStored of 2 blocks of 4 tokens has 7 tokens"):
        block_stored(HASHES[:2], None, list(range(7)), 4)


@pytest.fixture
def publisher():
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", topic="kv",
                            replay_endpoint="tcp://127.0.0.1:*", buffer_steps=2)
    publisher = KVEventPublisher(config, data_parallel_rank=0, context=zmq.Context())
    yield publisher
    publisher.close()


def _subscriber(publisher, topic: bytes = b"kv") -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.RCVTIMEO, 5000)
    socket.setsockopt(zmq.SUBSCRIBE, topic)
    socket.connect(publisher.endpoint())
    return socket


def _publish_until_received(publisher, subscriber, events) -> list[bytes]:
    """A SUB socket misses what was sent before it joined: publish until the first batch arrives."""
    subscriber.setsockopt(zmq.RCVTIMEO, 100)
    try:
        for _ in range(100):
            publisher.publish(events)
            try:
                return subscriber.recv_multipart()
            except zmq.Again:
                continue
        raise AssertionError("no batch arrived")
    finally:
        subscriber.setsockopt(zmq.RCVTIMEO, 5000)


def _receive_batch_of(subscriber, events, previous: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """(the batch received before it, the first batch carrying ``events``): repeats of the first batch published
    while the subscription was starting may come before it."""
    while True:
        frames = subscriber.recv_multipart()
        if msgpack.unpackb(frames[2])[1] == events:
            return previous, frames
        previous = frames


def test_batches_are_three_frames_with_consecutive_sequence_numbers(publisher):
    subscriber = _subscriber(publisher)
    first = _publish_until_received(publisher, subscriber, [all_blocks_cleared()])
    events = [block_stored(HASHES[:1], None, [1, 2, 3, 4], 4), block_removed(HASHES[:1])]
    publisher.publish([])  # nothing to send: no batch
    publisher.publish(events)
    before, (topic, seq, payload) = _receive_batch_of(subscriber, events, first)
    assert topic == before[0] == b"kv"
    assert int.from_bytes(seq, "big") == int.from_bytes(before[1], "big") + 1
    timestamp, received, rank = msgpack.unpackb(payload)
    assert timestamp > 0 and rank == 0 and received == events
    subscriber.close()


def test_replay_resends_the_buffered_batches_from_a_sequence_number(publisher):
    subscriber = _subscriber(publisher)
    _publish_until_received(publisher, subscriber, [all_blocks_cleared()])
    for i in range(3):
        publisher.publish([block_removed(HASHES[i : i + 1])])
    _, last = _receive_batch_of(subscriber, [block_removed(HASHES[2:3])], [])
    last_seq = int.from_bytes(last[1], "big")
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(publisher.replay_address())
    dealer.send_multipart([b"", (last_seq - 1).to_bytes(8, "big")])
    replies = [dealer.recv_multipart() for _ in range(3)]  # the last two batches (buffer_steps 2), then the end
    assert [(r[1], int.from_bytes(r[2], "big")) for r in replies[:2]] == [(b"kv", last_seq - 1), (b"kv", last_seq)]
    assert msgpack.unpackb(replies[1][3])[1] == [block_removed(HASHES[2:3])]
    assert replies[2] == [b"", b"kv", END_OF_REPLAY, b""]
    dealer.close()
    subscriber.close()


def test_sources_tell_a_router_where_to_subscribe(publisher):
    """vLLM's `GET /kv_event_sources` answer, with the ports the wildcard endpoints were bound to."""
    port = publisher.endpoint().rsplit(":", 1)[1]
    replay_port = publisher.replay_address().rsplit(":", 1)[1]
    assert publisher.sources() == {"0": {
        "endpoint": f"tcp://127.0.0.1:{port}", "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": "kv",
        "hwm": 100_000, "buffer_steps": 2, "publisher": "zmq", "encoding": "msgpack", "schema_version": 1,
        "enable_kv_cache_events": True}}
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0")
    wildcard = KVEventPublisher(config, context=zmq.Context())
    try:
        source = wildcard.sources()["0"]
        assert source["endpoint"] == "tcp://*:" + wildcard.endpoint().rsplit(":", 1)[1]  # the router fills the host
        assert source["replay_endpoint"] is None
    finally:
        wildcard.close()
