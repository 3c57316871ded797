"""Which schemas are refused as not enforced exactly, and the probe behind the list: for every refused
construct xgrammar's grammar accepts a value that the schema rejects (jsonschema says so), and for the
accepted look-alikes (exclusive oneOf, one-schema allOf, integer multipleOf) it accepts none of them."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import xgrammar as xgr
from pydantic import BaseModel, Field
from typing_extensions import Annotated, Literal

from kvboost_hf.server.decoding.schema_support import unsupported_construct

OBJ_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
# (schema, a value the schema rejects): xgrammar's grammar accepts each value all the same
NOT_ENFORCED = {
    "oneOf overlapping": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, 5),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, 1),
    "not": ({"type": "integer", "not": {"const": 5}}, 5),
    "if/then": ({**OBJ_AB, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, {"a": 1}),
    "dependentRequired": ({**OBJ_AB, "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    "dependentSchemas": ({**OBJ_AB, "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2, 1]),
    "multipleOf on a number": ({"type": "number", "multipleOf": 0.5}, 0.3),
}
# (schema, values the schema rejects): xgrammar's grammar accepts none of them
ENFORCED = {
    "oneOf of disjoint types": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, [True, 1.5]),
    "oneOf discriminated": ({"oneOf": [
        {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
        {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}]}, [{"k": "c"}]),
    "allOf of one schema": ({"allOf": [{"type": "integer", "maximum": 3}]}, [5]),
    "multipleOf on an integer": ({"type": "integer", "multipleOf": 3}, [4]),
}


_COMPILER = xgr.GrammarCompiler(xgr.TokenizerInfo(["<eos>", "a"], stop_token_ids=[0]))


def grammar_accepts(schema, value) -> bool:
    """Whether the grammar the server compiles for ``schema`` accepts ``value`` whole (then may stop)."""
    matcher = xgr.GrammarMatcher(_COMPILER.compile_json_schema(json.dumps(schema), any_whitespace=False))
    return matcher.accept_string(json.dumps(value)) and matcher.accept_token(0)  # the server's separators


@pytest.mark.parametrize("name", list(NOT_ENFORCED))
def test_each_refused_construct_is_one_the_grammar_does_not_enforce(name):
    schema, value = NOT_ENFORCED[name]
    assert not jsonschema.Draft202012Validator(schema).is_valid(value)
    assert grammar_accepts(schema, value), f"xgrammar now enforces {name}: stop refusing it"
    assert unsupported_construct(schema) is not None


@pytest.mark.parametrize("name", list(ENFORCED))
def test_look_alikes_the_grammar_enforces_are_accepted(name):
    schema, values = ENFORCED[name]
    for value in values:
        assert not jsonschema.Draft202012Validator(schema).is_valid(value)
        assert not grammar_accepts(schema, value)
    assert unsupported_construct(schema) is None


def test_where_the_construct_is_is_named_and_nested_schemas_are_searched():
    nested = {"type": "object", "properties": {"not": {"type": "string"},  # a property named "not" is fine
                                               "list": {"type": "array", "items": {"type": "number",
                                                                                   "multipleOf": 0.5}}}}
    assert unsupported_construct(nested) == ("'multipleOf' is enforced on integers only: give the schema "
                                             "\"type\": \"integer\" (at #/properties/list/items)")
    defs = {"$defs": {"A": {"anyOf": [{"type": "null"}, {"not": {"type": "null"}}]}}, "$ref": "#/$defs/A"}
    assert "at #/$defs/A/anyOf/1" in unsupported_construct(defs)
    assert unsupported_construct({"type": "object", "properties": {"a": {"type": "integer"}}}) is None
    assert unsupported_construct({"$ref": "#"}) is None  # a recursive schema ends (xgrammar judges it)


def test_pydantic_discriminated_unions_are_exact_and_plain_unions_use_anyof():
    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int = Field(ge=0, le=9)

    class Dog(BaseModel):
        kind: Literal["dog"]
        good: bool

    class Owner(BaseModel):
        pet: Annotated[Cat | Dog, Field(discriminator="kind")]
        nickname: str | None = None

    schema = Owner.model_json_schema()
    assert "oneOf" in json.dumps(schema)
    assert unsupported_construct(schema) is None


def test_objects_told_apart_by_a_forbidden_property_or_not_at_all():
    only_a = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    only_b = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"],
              "additionalProperties": False}
    assert unsupported_construct({"oneOf": [only_a, only_b]}) is None
    loose_b = {"type": "object", "properties": {"b": {"type": "integer"}}}  # {"a": 1} matches it too
    assert "branches 0 and 1" in unsupported_construct({"oneOf": [only_a, loose_b]})


def random_schema(rng: random.Random, depth: int = 0):
    """Schema-shaped garbage: keywords with values of every JSON type, nested."""
    keys = ["type", "oneOf", "anyOf", "allOf", "properties", "required", "items", "enum", "const", "$ref",
            "additionalProperties", "multipleOf", "not", "uniqueItems", "$defs", "x"]
    leaves = [None, True, 3, 0.5, "s", "#", "#/$defs/a", "integer", "object", [], {}, ["a", 1], {"a": 1}]
    if depth > 3 or rng.random() < 0.3:
        return rng.choice(leaves)
    if rng.random() < 0.3:
        return [random_schema(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(keys): random_schema(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def test_any_schema_shaped_value_gets_an_answer_not_an_exception():
    rng = random.Random(0)
    for _ in range(3000):
        schema = random_schema(rng)
        assert unsupported_construct(schema) is None or isinstance(unsupported_construct(schema), str)
    for required, properties in ((5, {}), ("a", []), (["a", 1], "p"), ([{"a": 1}], {"a": 7})):
        branch = {"type": "object", "required": required, "properties": properties}
        other = {"type": "object", "required": ["a"], "properties": {"a": {"const": 1}}}
        assert isinstance(unsupported_construct({"oneOf": [other, branch]}), str)
        assert isinstance(unsupported_construct({"oneOf": [branch, other]}), str)
    many = {"oneOf": [{"const": i} for i in range(65)]}
    assert "more than 64" in unsupported_construct(many)
    assert unsupported_construct({"oneOf": [{"const": i} for i in range(64)]}) is None

