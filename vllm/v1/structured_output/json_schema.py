"""Strict JSON schemas: no property the schema does not name.

llguidance, like JSON Schema, lets an object without ``additionalProperties`` hold any
other key, and a key it does not name may repeat (it tracks only the keys it names).
vLLM's default backend (xgrammar) compiles schemas in strict mode instead; so do we.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is a map of name -> schema, a list of schemas, or one schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = (
    "items",  # a list of schemas in drafts before 2020-12
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)
# Keys that say which properties an object may have beyond ``properties``.
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties")
_OBJECT_KEYS = ("properties", "patternProperties", "required", "minProperties", "maxProperties")


def _is_object_schema(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    if kind is None:
        return any(k in schema for k in _OBJECT_KEYS)
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


def strict_json_schema(schema: Any, *, mark: bool = True) -> Any:
    """A copy of ``schema`` where every object schema that does not set
    ``additionalProperties`` (or ``unevaluatedProperties``) gets
    ``"additionalProperties": false``; what the schema sets is kept as written.

    Walks every keyword that holds schemas (properties, items, prefixItems,
    anyOf/oneOf/allOf, $defs/definitions, additionalProperties when it is a schema...).
    The members of an ``allOf``, and an object schema with an ``allOf``, are left open:
    each names only part of the properties, so closing one would forbid the others'.
    ``schema`` is not mutated. ``RecursionError`` for a schema nested past Python's
    recursion limit."""
    if isinstance(schema, list):
        return [strict_json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema  # true / false, or a value where a schema should be
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_json_schema(s) for name, s in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_json_schema(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [strict_json_schema(s, mark=False) for s in out["allOf"]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict | list):
            out[key] = strict_json_schema(out[key])
    if (
        mark
        and "allOf" not in out
        and _is_object_schema(out)
        and not any(k in out for k in _OPEN_KEYS)
    ):
        out["additionalProperties"] = False
    return out
