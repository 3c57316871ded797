"""Numbers in structured replies bounded to what JSON parsers hold, so a weak model cannot run one on.

A JSON schema's ``integer`` or ``number`` without bounds admits any number of digits, and a base
model under a grammar happily writes ``"age": 30000000...`` until ``max_tokens``. Parsers hold
integers as int64 (or less) and numbers as float64 anyway, so the grammar is narrowed to that:

- an ``integer`` schema (``"type": "integer"`` or a type list with it but not ``number``) missing
  a lower or upper bound gets int64's (``minimum`` -2**63, ``maximum`` 2**63-1): 19 digits at
  most. A bound the schema gives is kept, whatever it is;
- a ``number`` schema (not also ``integer``) with one bound gets float64's largest magnitude on the other side (xgrammar
  writes a bounded number without exponent and with at most 6 decimals, so give both bounds to
  keep it short);
- a ``number`` without bounds, and numbers inside values the schema leaves free (``json_object``,
  ``{}``), are at most 17 digits before the point, 17 after it and a 3-digit exponent: every
  float64 has such a spelling (17 significant digits identify one; exponents run -324..308);
- an integer the schema does not type (inside free values) is at most 19 digits.

An integer with ``multipleOf`` is left as it is: xgrammar stops enforcing ``multipleOf`` once a
range is given (``schema_support`` refuses the two together).

Nothing a parser can hold is lost; only spellings no parser keeps exactly (a 20-digit integer,
an 18th significant digit) are. The first two are a schema rewrite (:func:`bound_schema`); the
last two replace xgrammar's two built-in number rules in the grammar it converts the schema to
(:func:`json_grammar_ebnf`; rule names of xgrammar 0.2.x, checked by the tests).
"""

from __future__ import annotations

import copy
import json
import logging
import re
import sys
from typing import Any

from kvboost_hf.server.decoding.schema_support import subschemas

logger = logging.getLogger(__name__)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT64_MAX = sys.float_info.max
INTEGER_DIGITS = 19  # int64: 9223372036854775807
SIGNIFICANT_DIGITS = 17  # enough to identify any float64 (Python's repr writes at most 17)
EXPONENT_DIGITS = 3  # float64 exponents run from -324 to 308

# xgrammar's built-in rules for untyped integers and numbers, with a bounded digit count.
_BOUNDED_RULES = {
    "basic_integer": f'("0" | "-"? [1-9] [0-9]{{0,{INTEGER_DIGITS - 1}}})',
    "basic_number": (f'("-"? ("0" | [1-9] [0-9]{{0,{SIGNIFICANT_DIGITS - 1}}}) ("." [0-9]{{1,{SIGNIFICANT_DIGITS}}})? '
                     f'([eE] [+\\-]? [0-9]{{1,{EXPONENT_DIGITS}}})?)'),
}
_RULE_LINE = {name: re.compile(rf"^{name} ::= .*$", re.MULTILINE) for name in _BOUNDED_RULES}


def _types(node: dict[str, Any]) -> list[Any]:
    declared = node.get("type")
    return [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else []


def _bound(node: dict[str, Any], low: float, high: float) -> None:
    if "minimum" not in node and "exclusiveMinimum" not in node:
        node["minimum"] = low
    if "maximum" not in node and "exclusiveMaximum" not in node:
        node["maximum"] = high


def bound_schema(schema: Any) -> Any:
    """A copy of ``schema`` whose integers are bounded to int64 and one-sided numbers to float64 where
    the schema leaves a side open (``schema`` itself is not changed)."""
    if not isinstance(schema, dict):
        return schema
    schema = copy.deepcopy(schema)
    for node in subschemas(schema):
        if "enum" in node or "const" in node or "multipleOf" in node:
            continue  # listed values are bounded; xgrammar drops multipleOf once a range is given
        types = _types(node)
        if "number" in types and "integer" in types:
            continue  # int64 bounds would cut off larger numbers, and xgrammar refuses float64's on integers
        if "number" in types:
            low = "minimum" in node or "exclusiveMinimum" in node
            high = "maximum" in node or "exclusiveMaximum" in node
            if low != high:  # both open: the digit-bounded number rule applies, shorter than a range
                _bound(node, -FLOAT64_MAX, FLOAT64_MAX)
        elif "integer" in types:
            _bound(node, INT64_MIN, INT64_MAX)
    return schema


def bound_numbers_in_ebnf(ebnf: str) -> str:
    """``ebnf`` (xgrammar's conversion of a JSON schema) with its built-in number rules bounded."""
    for name, body in _BOUNDED_RULES.items():
        ebnf, found = _RULE_LINE[name].subn(f"{name} ::= {body}", ebnf, count=1)
        if not found:
            logger.warning("xgrammar's grammar has no %r rule: untyped numbers are not bounded in digits", name)
    return ebnf


def json_grammar_ebnf(schema_text: str) -> str:
    """The EBNF grammar of the JSON values ``schema_text`` allows, numbers bounded (see the module doc),
    with fixed separators and no free whitespace. Raises xgrammar's errors for a bad schema."""
    import xgrammar as xgr

    schema = bound_schema(json.loads(schema_text))
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return bound_numbers_in_ebnf(str(grammar))
