"""Which JSON-schema constructs the grammar enforces exactly, and a check that refuses the others.

xgrammar compiles a schema into a grammar of the values it allows. For most keywords that set is
exactly the schema's, but for a few it is larger, so a "guaranteed" reply could fail validation
(probed on xgrammar 0.2.8; ``tests/server/decoding/test_schema_support.py`` re-probes every one of them):

- ``oneOf`` is decoded as ``anyOf``: a value may match two branches. Exact only when no value can
  match two of them, which :func:`unsupported_construct` proves for branches of disjoint types, or
  with a common required property whose ``const`` / ``enum`` values differ (a discriminated union,
  as pydantic writes one), or with a required property the other branch forbids
  (``additionalProperties: false``);
- ``allOf`` with more than one branch, ``not``, ``if`` / ``then`` / ``else``,
  ``dependentRequired``, ``dependentSchemas`` and ``uniqueItems: true`` are not enforced;
- ``multipleOf`` is enforced on integers only, and only without ``minimum`` / ``maximum`` (xgrammar
  drops it once a range is given).

A schema using one of them anywhere is refused before generation (the request's 400 names
``response_format`` or ``tools``), so every structured reply validates against its schema.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from itertools import combinations
from typing import Any

logger = logging.getLogger(__name__)

NOT_ENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalProperties", "contains", "propertyNames", "not", "if", "then", "else",
                  "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_JSON_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
_MAX_REF_DEPTH = 32
_RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
MAX_ONEOF_BRANCHES = 64  # pairs are compared: more branches than this are not checked, but refused


class _Refs:
    """Local ``$ref`` resolution (``#`` and ``#/a/b`` pointers) against the root schema."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root

    def resolve(self, schema: Any) -> Any:
        for _ in range(_MAX_REF_DEPTH):
            ref = schema.get("$ref") if isinstance(schema, dict) else None
            if not isinstance(ref, str) or not ref.startswith("#"):
                return schema
            target: Any = self.root
            for part in (p for p in ref[1:].split("/") if p):
                part = part.replace("~1", "/").replace("~0", "~")
                target = target.get(part) if isinstance(target, dict) else None
            if target is None:
                return schema  # xgrammar reports a dangling reference itself
            schema = target
        return schema


def unsupported_construct(schema: Any) -> str | None:
    """None when the grammar enforces ``schema`` exactly, else a message naming the first construct it
    does not (and where it is, as a JSON pointer)."""
    if not isinstance(schema, dict):
        return None
    refs = _Refs(schema)
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        problem = _node_problem(node, refs)
        if problem is not None:
            return f"{problem} (at {where})"
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((sub, f"{where}/{key}/{name}") for name, sub in node[key].items())
        for key in _SCHEMA_VALUES:
            if isinstance(node.get(key), dict):
                stack.append((node[key], f"{where}/{key}"))
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend((sub, f"{where}/{key}/{i}") for i, sub in enumerate(node[key]))
    return None


def subschemas(schema: Any) -> Iterator[dict[str, Any]]:
    """Every schema object inside ``schema`` (itself included) that a keyword applies a schema through, once each."""
    seen: set[int] = set()
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        for key in _SCHEMA_VALUES:
            if isinstance(node.get(key), dict):
                stack.append(node[key])
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])


def _node_problem(node: dict[str, Any], refs: _Refs) -> str | None:
    for key in NOT_ENFORCED:
        if key in node:
            return f"'{key}' is not enforced by the grammar"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' with more than one schema is not enforced by the grammar: merge them into one"
    if node.get("uniqueItems") is True:
        return "'uniqueItems' is not enforced by the grammar"
    if "multipleOf" in node and _types(node, refs) != {"integer"}:
        return "'multipleOf' is enforced on integers only: give the schema \"type\": \"integer\""
    if "multipleOf" in node and any(key in node for key in _RANGE):
        return "'multipleOf' is not enforced by the grammar together with a minimum or maximum: drop one of them"
    branches = node.get("oneOf")
    if isinstance(branches, list) and len(branches) > MAX_ONEOF_BRANCHES:
        return f"'oneOf' with more than {MAX_ONEOF_BRANCHES} branches is not checked for overlap: use anyOf"
    if isinstance(branches, list):
        resolved = [refs.resolve(b) for b in branches]
        for (i, a), (j, b) in combinations(enumerate(resolved), 2):
            if not _disjoint(a, b, refs):
                return (f"'oneOf' branches {i} and {j} can match the same value, and the grammar enforces oneOf as "
                        f"anyOf: use anyOf, or make the branches exclusive (e.g. a required property with a "
                        f"different const in each)")
    return None


def _types(schema: Any, refs: _Refs) -> set[str]:
    """The JSON types a schema's values can have (all of them when it does not say)."""
    schema = refs.resolve(schema)
    if schema is False:
        return set()
    if not isinstance(schema, dict):
        return set(_JSON_TYPES)
    if "const" in schema:
        return {_type_of(schema["const"])}
    if isinstance(schema.get("enum"), list):
        return {_type_of(v) for v in schema["enum"]}
    declared = schema.get("type")
    if isinstance(declared, str):
        declared = [declared]
    if isinstance(declared, list):
        types = {t for t in declared if t in _JSON_TYPES}
        return types | ({"integer"} if "number" in types else set())  # an integer is a number
    return set(_JSON_TYPES)


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "object")


def _values(schema: Any, refs: _Refs) -> list[Any] | None:
    """The values a schema allows when it lists them (``const`` / ``enum``), else None."""
    schema = refs.resolve(schema)
    if isinstance(schema, dict):
        if "const" in schema:
            return [schema["const"]]
        if isinstance(schema.get("enum"), list):
            return list(schema["enum"])
    return None


def _disjoint(a: Any, b: Any, refs: _Refs) -> bool:
    """Whether no value can match both schemas (False when that cannot be shown simply)."""
    types_a, types_b = _types(a, refs), _types(b, refs)
    if not types_a & types_b:
        return True
    values_a, values_b = _values(a, refs), _values(b, refs)
    if values_a is not None and values_b is not None and not any(v in values_b for v in values_a):
        return True
    if types_a & types_b != {"object"} or not isinstance(a, dict) or not isinstance(b, dict):
        return False
    return _objects_exclusive(a, b, refs) or _objects_exclusive(b, a, refs)


def _properties(schema: dict[str, Any]) -> dict[str, Any]:
    value = schema.get("properties")
    return value if isinstance(value, dict) else {}


def _required(schema: dict[str, Any]) -> list[str]:
    value = schema.get("required")
    return [name for name in value if isinstance(name, str)] if isinstance(value, list) else []


def _objects_exclusive(a: dict[str, Any], b: dict[str, Any], refs: _Refs) -> bool:
    """Objects: a property ``a`` requires that ``b`` forbids, or that both require with disjoint listed values."""
    props_a, props_b = _properties(a), _properties(b)
    required_b = set(_required(b))
    for name in _required(a):
        if name not in props_b and b.get("additionalProperties") is False and not b.get("patternProperties"):
            return True
        if name in required_b:
            values_a, values_b = _values(props_a.get(name), refs), _values(props_b.get(name), refs)
            if values_a is not None and values_b is not None and not any(v in values_b for v in values_a):
                return True
    return False
