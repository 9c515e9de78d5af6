"""The runner calls host 0 sends to the other hosts of a multi-host server, as msgpack bytes.

Place in the data flow: `serving_hosts.ReplicatedRunner` (host 0) encodes each device call its engine makes
(`execute`, `resample`, `copy_blocks`, `write_slot`, the fork programs' compile) with its arguments, the step's padded
host arrays; `serving_hosts.follow` (every other host) decodes it and makes the same call on its own runner, so
the same SPMD program runs on every host with the same inputs.

A message is `[runner, method, args]`. Arrays keep their dtype and shape; large arrays of mostly one value (a sampler
slot's vocabulary-sized rows, mostly zeros; a step's grammar masks, all ones without a grammar) travel as that
value and the entries that differ. A device array or `StepOutput` an earlier call
returned travels as its number (`OutputHandles`): both sides number the outputs of their calls in the same order.
Only the classes registered here are rebuilt.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import msgpack
import numpy as np

from jaxserve.core.buckets import DecodeBucket, MixedBucket, PrefillBucket
from jaxserve.runner.input_batch import StepInputs
from jaxserve.runner.model_runner import StepOutput
from jaxserve.runner.sampler import SamplingTensors
from jaxserve.runner.spec_verify import VerifyInputs
from jaxserve.wire import dataclass_values, rebuild_dataclass

_ARRAY, _SPARSE_ARRAY, _DATACLASS, _OUTPUT, _OUTPUT_TOKENS = 1, 2, 3, 4, 5
_CLASSES = {cls.__name__: cls for cls in (
    DecodeBucket, PrefillBucket, MixedBucket, StepInputs, SamplingTensors, VerifyInputs,
)}
SPARSE_MIN_SIZE = 1024  # arrays this large travel as their first value and the entries that differ from it, when
# at most 1/8 of them do
KEPT_OUTPUTS = 16  # outputs a later call may still name (a step reads the one before it, a resample its own)


class OutputHandles:
    """Numbers the StepOutputs of the replayed calls, in call order, and keeps the last `KEPT_OUTPUTS`."""

    def __init__(self):
        self._outputs: collections.OrderedDict[int, StepOutput] = collections.OrderedDict()
        self._by_id: dict[int, tuple[int, int]] = {}  # id(output or its tokens) -> (kind, number)
        self._count = 0

    def add(self, output):
        if isinstance(output, StepOutput):
            number, self._count = self._count, self._count + 1
            self._outputs[number] = output
            self._by_id[id(output)] = (_OUTPUT, number)
            self._by_id[id(output.tokens)] = (_OUTPUT_TOKENS, number)
            while len(self._outputs) > KEPT_OUTPUTS:
                _, old = self._outputs.popitem(last=False)
                self._by_id.pop(id(old), None)
                self._by_id.pop(id(old.tokens), None)
        return output

    def handle(self, obj) -> tuple[int, int] | None:
        return self._by_id.get(id(obj))

    def resolve(self, kind: int, number: int):
        output = self._outputs.get(number)
        if output is None:
            raise ValueError(f"a replayed call names output {number}, which this host no longer holds")
        return output if kind == _OUTPUT else output.tokens


def encode(message, handles: OutputHandles) -> bytes:
    def pack(obj):
        handle = handles.handle(obj)
        if handle is not None:
            return msgpack.ExtType(handle[0], msgpack.packb(handle[1]))
        if isinstance(obj, tuple):
            return list(obj)
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray | jax.Array):
            return _pack_array(np.asarray(obj))
        cls = type(obj)
        if dataclasses.is_dataclass(obj) and _CLASSES.get(cls.__name__) is cls:
            values = dataclass_values(obj)
            return msgpack.ExtType(_DATACLASS, msgpack.packb([cls.__name__, values], default=pack, strict_types=True))
        raise TypeError(f"cannot send a {cls.__name__} to the other hosts")

    return msgpack.packb(message, default=pack, strict_types=True)


def decode(data: bytes, handles: OutputHandles):
    def unpack(code: int, payload: bytes):
        if code in (_OUTPUT, _OUTPUT_TOKENS):
            return handles.resolve(code, msgpack.unpackb(payload))
        if code in (_ARRAY, _SPARSE_ARRAY):
            return _unpack_array(code, payload)
        name, values = msgpack.unpackb(payload, ext_hook=unpack)
        if code != _DATACLASS or name not in _CLASSES:
            raise ValueError(f"unknown object in a replayed runner call: {name!r}")
        return rebuild_dataclass(_CLASSES[name], values)

    return msgpack.unpackb(data, ext_hook=unpack, strict_map_key=False)


def _pack_array(array: np.ndarray) -> msgpack.ExtType:
    """Large arrays of mostly one value (zeros; a step's allow-all grammar masks) as that value and the others."""
    array = np.ascontiguousarray(array)
    header = [array.dtype.str, list(array.shape)]
    if array.size >= SPARSE_MIN_SIZE:
        flat = array.reshape(-1)
        others = np.flatnonzero(flat != flat[0])
        if len(others) * 8 <= flat.size:
            sparse = [*header, flat[:1].tobytes(), others.astype(np.int32).tobytes(), flat[others].tobytes()]
            return msgpack.ExtType(_SPARSE_ARRAY, msgpack.packb(sparse))
    return msgpack.ExtType(_ARRAY, msgpack.packb([*header, array.tobytes()]))


def _unpack_array(code: int, payload: bytes) -> np.ndarray:
    if code == _ARRAY:
        dtype, shape, data = msgpack.unpackb(payload)
        return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()
    dtype, shape, fill, index, values = msgpack.unpackb(payload)
    array = np.full(int(np.prod(shape)), np.frombuffer(fill, np.dtype(dtype))[0])
    array[np.frombuffer(index, np.int32)] = np.frombuffer(values, np.dtype(dtype))
    return array.reshape(shape)
