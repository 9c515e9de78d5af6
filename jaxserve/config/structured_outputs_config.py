"""How the engine enforces structured outputs: vLLM's `structured_outputs_config` (`--structured-outputs-config
'{...}'`), with the keys that mean something for jaxserve's one grammar backend (llguidance).

Place in the data flow: `EngineConfig.structured_outputs_config` holds a `StructuredOutputsConfig` (parsed from a
dict or a JSON object); the engine's grammar compiler (`engine/structured_outputs.py`) reads it when it turns a
request's `StructuredOutputsParams` into a matcher: how strict a JSON schema is, and whether a constraint waits
for the request's reasoning to end.
"""

from __future__ import annotations

import dataclasses

from jaxserve.config.dict_options import as_dict, check_known_keys


@dataclasses.dataclass(frozen=True)
class StructuredOutputsConfig:
    """`structured_outputs_config`: vLLM's keys.

    - `disable_additional_properties`: a JSON schema's objects allow no properties beyond those they name unless
      their `additionalProperties` says otherwise: what vLLM's default backend (xgrammar, strict mode) does, and
      its guidance backend with this key. True by default here (vLLM's key defaults to False because only its
      guidance backend reads it); False compiles schemas as JSON Schema reads them (unnamed properties allowed).
      A request's `structured_outputs.disable_additional_properties` overrides it.
    - `enable_in_reasoning`: constraints apply from the first token, reasoning included; by default a constraint
      whose request gives a `reasoning_end` marker (the chat server sets it under `--reasoning-parser`) waits
      until the output holds that marker, as vLLM's grammar waits for the reasoning parser's end."""

    disable_additional_properties: bool = True
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if not isinstance(getattr(self, field.name), bool):
                raise ValueError(f"structured_outputs_config: {field.name} must be true or false, "
                                 f"got {getattr(self, field.name)!r}")

    @classmethod
    def parse(cls, value: StructuredOutputsConfig | dict | str | None) -> StructuredOutputsConfig:
        """A config from what a user gives: itself, a dict, or a JSON object (the command line's); None: defaults."""
        if value is None:
            return cls()
        if isinstance(value, StructuredOutputsConfig):
            return value
        value = as_dict(value, "structured_outputs_config")
        check_known_keys(value, [field.name for field in dataclasses.fields(cls)], "structured_outputs_config")
        return cls(**value)
