"""JSON schemas as vLLM's default structured-output backend (xgrammar, strict) reads them.

JSON Schema lets an object carry any property its schema does not list unless the
schema says `additionalProperties: false`; xgrammar's strict mode, vLLM's default,
generates only the listed ones unless the schema says `additionalProperties: true`
(or gives a schema for them). llguidance follows JSON Schema, so a model unsure of
what comes next may wander into keys of its own until `max_tokens` cuts the JSON.
`closed_objects` writes `additionalProperties: false` into every object schema that
lists `properties` and says nothing of other keys (nor `patternProperties`), in
every place a schema may nest; an object schema without `properties` stays open
(`{"type": "object"}` is any object). The walk follows the keywords that hold
schemas, so a property merely named `properties` or `items` is not mistaken for one.
"""

from __future__ import annotations

import json
from typing import Any

_ONE = (
    "additionalProperties",
    "items",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "additionalItems",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_BY_NAME = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _close(schema: Any) -> Any:
    if isinstance(schema, list):  # draft-4 style tuple `items`
        return [_close(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = _close(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [_close(s) for s in out[key]]
    for key in _BY_NAME:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(s) for name, s in out[key].items()}
    if "properties" in out and not {"additionalProperties", "patternProperties"} & set(out):
        out["additionalProperties"] = False
    return out


def closed_objects(schema: str | dict[str, Any]) -> str:
    """The schema (JSON text or a dict) with its listed objects closed, as JSON text
    (key order kept: it is the order properties are generated in)."""
    value = json.loads(schema) if isinstance(schema, str) else schema
    return json.dumps(_close(value), separators=(",", ":"))
