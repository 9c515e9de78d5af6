"""JSON schema rewrites, done before a schema becomes a grammar: strict objects, and schemas nested in another.

Place in the data flow: `StructuredOutputsParams` (`sampling_params.py`) compiles a JSON schema strict
(`strict_schema`) unless the request or `structured_outputs_config` says otherwise, and the chat server's forced
tool calls (`entrypoints/tool_choice.py`) put each tool's schema under one "required" schema (`nest_schema`: its
`$defs` lifted to the root). Both return new dicts; a user's schema is never changed in place.

Strict is what vLLM's default backend (xgrammar's strict mode) does: an object schema that names its properties
allows no others unless its `additionalProperties` says so. Written as vLLM's guidance backend writes it
(`additionalProperties: false` on every schema with `properties` or `patternProperties` and no
`additionalProperties`), except where that would make a schema unsatisfiable for llguidance, which intersects the
schemas an object must meet: the members of an `allOf` stay open, and those of an `anyOf` or `oneOf` whose parent
names properties too (the parent names every member's properties and closes); a schema whose `$ref` or
applicator members cannot be read inline is left as given.
"""

from __future__ import annotations

from typing import Any

SCHEMA_KEYWORDS = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
                   "propertyNames", "unevaluatedProperties", "unevaluatedItems")  # a schema as their value
SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LIST_KEYWORDS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
APPLICATORS = ("allOf", "anyOf", "oneOf")
DEFINITIONS = ("$defs", "definitions")
DATA_KEYWORDS = ("const", "enum", "default", "examples")  # values, not schemas: never rewritten


def strict_schema(schema: Any) -> Any:
    """``schema`` with `additionalProperties: false` on each object schema that names properties and says nothing
    of others (see the module docstring for `allOf` and `$ref`)."""
    return _strict(schema, open_object=False)


def _strict(schema: Any, open_object: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    names_properties = _names_properties(schema)
    out = _map_subschemas(schema, lambda sub, keyword: _strict(
        sub, open_object=keyword == "allOf" or (keyword in APPLICATORS and names_properties)))
    if open_object or "additionalProperties" in out or not names_properties:
        return out
    members = [m for keyword in APPLICATORS for m in out.get(keyword, [])]
    if "$ref" in out or not all(isinstance(m, dict) and "$ref" not in m for m in members):
        return out  # properties named where they cannot be read here: left as given
    properties = dict(out.get("properties", {}))
    for member in members:
        for name in member.get("properties", {}):
            properties.setdefault(name, {})  # a member's property, allowed here, checked by the member
    if properties:
        out["properties"] = properties
    out["additionalProperties"] = False
    return out


def _names_properties(schema: dict) -> bool:
    """An object schema that names properties itself or through an `allOf` member."""
    if "properties" in schema or "patternProperties" in schema:
        return True
    return any(isinstance(m, dict) and ("properties" in m or "patternProperties" in m) for m in schema.get("allOf", []))


def _map_subschemas(schema: dict, rewrite) -> dict:
    """A copy of ``schema`` with ``rewrite(subschema, keyword)`` applied to each of its direct subschemas (the values
    of `DATA_KEYWORDS` are data, never rewritten)."""
    out = dict(schema)
    for keyword, value in schema.items():
        if keyword in SCHEMA_MAP_KEYWORDS and isinstance(value, dict):
            out[keyword] = {name: rewrite(sub, keyword) for name, sub in value.items()}
        elif keyword in SCHEMA_LIST_KEYWORDS and isinstance(value, list):
            out[keyword] = [rewrite(sub, keyword) for sub in value]
        elif keyword in SCHEMA_KEYWORDS and isinstance(value, dict):
            out[keyword] = rewrite(value, keyword)
    return out


def nest_schema(schema: dict, pointer: str, taken: dict[str, Any], prefix: str) -> dict:
    """``schema`` to be placed at JSON pointer ``pointer`` of a combined schema whose root `$defs` are ``taken``
    (updated in place): its definitions (`$defs`, `definitions`) move into ``taken``, renamed ``prefix`` + name
    where the name is taken already, and its local `$ref`s are rewritten to match (a reference to its own root
    or to any other place in it points under ``pointer``)."""
    definitions = [(keyword, name, definition) for keyword in DEFINITIONS
                   for name, definition in (schema.get(keyword) or {}).items()]
    renames = {f"#/{keyword}/{_escape(name)}": _free_name(name, taken, prefix) for keyword, name, _ in definitions}
    for keyword, name, definition in definitions:
        taken[renames[f"#/{keyword}/{_escape(name)}"]] = _rewrite_refs(definition, renames, pointer)
    return _rewrite_refs({k: v for k, v in schema.items() if k not in DEFINITIONS}, renames, pointer)


def _free_name(name: str, taken: dict[str, Any], prefix: str) -> str:
    """The root `$defs` name of a definition: its own, else ``prefix`` + it (numbered if need be); reserved."""
    candidate, number = name, 1
    while candidate in taken:
        candidate = f"{prefix}{name}" if number == 1 else f"{prefix}{name}_{number}"
        number += 1
    taken[candidate] = None  # reserved; nest_schema stores the rewritten definition
    return candidate


def _escape(name: str) -> str:
    """A name as a JSON pointer writes it."""
    return name.replace("~", "~0").replace("/", "~1")


def _rewrite_refs(value: Any, renames: dict[str, str], pointer: str) -> Any:
    if isinstance(value, list):
        return [_rewrite_refs(v, renames, pointer) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: v if k in DATA_KEYWORDS else _rewrite_refs(v, renames, pointer) for k, v in value.items()}
    ref = value.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = _moved_ref(ref, renames, pointer)
    return out


def _moved_ref(ref: str, renames: dict[str, str], pointer: str) -> str:
    for old, new_name in renames.items():
        if ref == old or ref.startswith(old + "/"):
            return f"#/$defs/{_escape(new_name)}" + ref[len(old):]
    return "#" + pointer + ref[1:]
