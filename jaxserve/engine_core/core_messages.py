"""The messages between the API process and the engine core process, as msgpack bytes.

Place in the data flow: `core_client.py` (API process) sends requests and aborts, `core_process.py` (core
process) sends each step's outputs back, both over ZeroMQ; this module turns them into bytes and back.
Dataclasses travel as an extension type holding the class name and the field values, and only the classes
registered here are rebuilt (nothing else can be named by a message); enums by name and value. Tuples become
lists, numpy scalars Python numbers, and int dict keys stay ints (logprobs are keyed by token id).

Inputs (client -> core): ["add", request_id, prompt, params, priority], ["abort", [request_id, ...]],
["shutdown"], ["call", call_id, method] (an engine method of `CALLABLE`, run between steps).
Outputs (core -> client): ["outputs", [[request_id, RequestOutput], ...], [[request_id, error type, message], ...],
StatsSnapshot, backend compiles]; ["call_result", call_id, result, error message or None]; ["dead", reason] when
the core cannot go on (multi-host: a host was lost).
"""

from __future__ import annotations

import dataclasses
import enum

import msgpack
import numpy as np

from jaxserve.metrics.stats import EngineStats, SchedulerStats, StatsSnapshot
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams
from jaxserve.wire import dataclass_values, rebuild_dataclass

ADD, ABORT, SHUTDOWN, OUTPUTS, DEAD = "add", "abort", "shutdown", "outputs", "dead"
CALL, CALL_RESULT = "call", "call_result"
CALLABLE = frozenset({"reset_prefix_cache"})  # the LLMEngine methods the API process may call in the core

_DATACLASS, _ENUM = 1, 2
_CLASSES = {cls.__name__: cls for cls in (
    SamplingParams, BeamSearchParams, StructuredOutputsParams, RequestOutput, CompletionOutput, Logprob,
    StatsSnapshot, SchedulerStats, EngineStats,
)}
_ENUMS = {cls.__name__: cls for cls in (RequestOutputKind,)}


def encode(message) -> bytes:
    return msgpack.packb(message, default=_pack_object, strict_types=True)  # IntEnums must reach _pack_object


def decode(data: bytes):
    return msgpack.unpackb(data, ext_hook=_unpack_object, strict_map_key=False)


def _pack_object(obj):
    cls = type(obj)
    if isinstance(obj, enum.Enum) and _ENUMS.get(cls.__name__) is cls:
        return msgpack.ExtType(_ENUM, encode([cls.__name__, obj.value]))
    if dataclasses.is_dataclass(obj) and _CLASSES.get(cls.__name__) is cls:
        return msgpack.ExtType(_DATACLASS, encode([cls.__name__, dataclass_values(obj)]))
    if isinstance(obj, tuple):
        return list(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"cannot send a {cls.__name__} to or from the engine core")


def _unpack_object(code: int, data: bytes):
    name, values = decode(data)
    if code == _ENUM:
        return _ENUMS[name](values)
    if code != _DATACLASS or name not in _CLASSES:
        raise ValueError(f"unknown object in an engine core message: {name!r}")
    return rebuild_dataclass(_CLASSES[name], values)
