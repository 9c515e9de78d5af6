"""What the two message formats share: a registered dataclass travels as its field values and is rebuilt from them.

Place in the data flow: `engine_core/core_messages.py` (between the API process and the engine core process) and
`replication/step_messages.py` (host 0's runner calls, sent to the other hosts) each keep their own registry of the
classes a message may name; both turn an object into its values and back with these two functions.
"""

from __future__ import annotations

import dataclasses


def dataclass_values(obj) -> list:
    """The field values of the dataclass ``obj``, in field order (what `rebuild_dataclass` takes back)."""
    return [getattr(obj, field.name) for field in dataclasses.fields(obj)]


def rebuild_dataclass(cls, values: list):
    """A ``cls`` with these field values, in field order; the sender's object was valid, so no __post_init__ checks
    run again (frozen classes too)."""
    obj = object.__new__(cls)
    for field, value in zip(dataclasses.fields(cls), values, strict=True):
        object.__setattr__(obj, field.name, value)
    return obj
