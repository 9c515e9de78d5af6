"""KV cache events for KV-aware routers: vLLM's `kv_events_config` (`--kv-events-config '{...}'`).

Place in the data flow: `EngineConfig.kv_events_config` holds a `KVEventsConfig` (parsed from a dict or a JSON
object); each data-parallel replica takes its own endpoints (`for_rank`), and `jaxserve.engine.kv_events`
publishes the blocks the prefix cache stores and evicts where `publishes` says so.
"""

from __future__ import annotations

import dataclasses

from jaxserve.config.dict_options import as_dict, check_known_keys


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """`kv_events_config`: vLLM's `KVEventsConfig` keys and defaults (`--kv-events-config '{...}'`): the engine
    publishes the blocks its prefix cache stores and evicts for KV-aware routers (`engine/kv_events.py`)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"  # bound when it has a wildcard host (or is ipc/inproc), else connected
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config: enable_kv_cache_events must be true or false, "
                             f"got {self.enable_kv_cache_events!r}")
        if self.publisher not in (None, "zmq", "null"):
            raise ValueError(f"kv_events_config: publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config: {key} must be a positive integer, got {value!r}")
        for key in ("endpoint", "topic"):
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"kv_events_config: {key} must be a string, got {getattr(self, key)!r}")

    @property
    def publishes(self) -> bool:
        """Whether events are published: enabled, and not to the "null" publisher."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    def for_rank(self, data_parallel_rank: int) -> KVEventsConfig:
        """Data-parallel replica ``rank``'s endpoints, as vLLM offsets them: a TCP port plus the rank (a port the
        system picks, 0 or *, stays so)."""
        if data_parallel_rank == 0:
            return self
        replay = self.replay_endpoint
        return dataclasses.replace(self, endpoint=_offset_port(self.endpoint, data_parallel_rank),
                                   replay_endpoint=None if replay is None else _offset_port(replay, data_parallel_rank))

    @classmethod
    def parse(cls, value: KVEventsConfig | dict | str | None) -> KVEventsConfig | None:
        """A config from what a user gives: itself, a dict, or a JSON object (the command line's)."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        value = as_dict(value, "kv_events_config")
        check_known_keys(value, [field.name for field in dataclasses.fields(cls)], "kv_events_config")
        return cls(**value)


def _offset_port(endpoint: str, offset: int) -> str:
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, port = endpoint.rsplit(":", 1)
    return endpoint if port in ("0", "*") else f"{host}:{int(port) + offset}"
