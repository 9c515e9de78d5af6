"""Dict-valued options (`speculative_config`, `kv_events_config`, `structured_outputs_config`) read from what a user
gives.

Place in the data flow: `LLM(...)` passes these options as dicts, `jaxserve serve` as JSON objects from the
command line; each config's `parse` turns either into a dict here before
checking its keys (`check_known_keys`), so a malformed value fails with the option's name.
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


def check_known_keys(value: dict, known: list[str], option: str) -> None:
    """Refuses keys the option does not have, naming them and the known ones."""
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{option}: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
