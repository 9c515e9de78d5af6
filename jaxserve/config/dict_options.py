"""Dict-valued options (`speculative_config`, `kv_events_config`) read from what a user gives.

Place in the data flow: `LLM(...)` passes these options as dicts, `jaxserve serve` as JSON objects from the
command line; `SpeculativeConfig.parse` and `KVEventsConfig.parse` turn either into a dict here before
checking its keys, so a malformed value fails with the option's name.
"""

from __future__ import annotations

import json


def as_dict(value: object, option: str) -> dict:
    """A dict-valued option as a dict: given as one, or as a JSON object (the command line's); errors name it."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{option}: not a JSON object: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} must be a dict or a JSON object, got {type(value).__name__}")
    return value
