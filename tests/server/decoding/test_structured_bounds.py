"""Numbers in structured replies are bounded to what JSON parsers hold, and whitespace is fixed.

Mask-level: the grammar mask (``GrammarCompilers.json_processor``) on a character vocabulary, fed
a reply character by character; which characters it allows next is what generation could pick.
"""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch

from kvboost_hf.server.decoding.structured import GrammarCompilers
from tests.conftest import VOCAB
from tests.server.decoding.test_grammar_mask import char_tokenizer

EOS = 2
INT64_MIN, INT64_MAX, FLOAT64_MAX = -(2**63), 2**63 - 1, sys.float_info.max


@pytest.fixture(scope="module")
def grammar():
    """``allowed(schema, text)``: the characters (and "<eos>") the mask allows after ``text``."""
    tokenizer, grammars = char_tokenizer(), GrammarCompilers()
    vocab = tokenizer.get_vocab()
    names = {i: p for p, i in vocab.items()}

    def allowed(schema: dict, text: str) -> set[str]:
        mask = grammars.json_processor(tokenizer, VOCAB, [EOS], schema)
        prompt = [1]
        mask(torch.tensor([prompt]), torch.zeros(1, VOCAB))  # the first call fixes the prompt length
        ids = [vocab[c] for c in text]
        scores = mask(torch.tensor([prompt + ids]), torch.zeros(1, VOCAB))[0]
        return {"<eos>" if i == EOS else names[i] for i in torch.nonzero(scores > float("-inf")).flatten().tolist()}

    return allowed


def completes(allowed, schema: dict, text: str) -> bool:
    """Whether the mask lets ``text`` through character by character and then allows the end."""
    return all(text[i] in allowed(schema, text[:i]) for i in range(len(text))) and "<eos>" in allowed(schema, text)


AGE = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
X = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
DIGITS = set("0123456789")


def test_an_unbounded_integer_stops_at_int64(grammar):
    assert "1" in grammar(AGE, '{"age": ' + "1" * 18)
    assert not DIGITS & grammar(AGE, '{"age": ' + "1" * 19), "a 20-digit integer is refused"
    assert grammar(AGE, '{"age": ' + "1" * 19) == {"}"}
    assert completes(grammar, AGE, '{"age": %d}' % INT64_MAX)
    assert completes(grammar, AGE, '{"age": %d}' % INT64_MIN)
    assert "8" not in grammar(AGE, '{"age": 922337203685477580'), "above int64's maximum"
    assert "9" not in grammar(AGE, '{"age": -922337203685477580'), "below int64's minimum"


def test_a_one_sided_integer_gets_the_other_int64_bound(grammar):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}, "required": ["n"]}
    assert not DIGITS & grammar(schema, '{"n": ' + "1" * 19)
    assert "-" not in grammar(schema, '{"n": '), "the schema's own bound is kept"


def test_an_unbounded_number_has_float64_digits(grammar):
    assert not DIGITS & grammar(X, '{"x": ' + "1" * 17), "18 digits before the point are refused"
    assert {".", "e"} <= grammar(X, '{"x": ' + "1" * 17)
    assert not DIGITS & grammar(X, '{"x": 1.' + "1" * 17), "18 decimals are refused"
    assert not DIGITS & grammar(X, '{"x": 1e123'), "a 4-digit exponent is refused"
    for value in (FLOAT64_MAX, -5e-324, 0.1, 1 / 3, 123456789.125, 2.0**60, -0.0):
        text = json.dumps({"x": value}).replace("e+", "e")  # the character vocabulary has no "+"
        assert completes(grammar, X, text), value  # every float64 keeps a spelling


def test_numbers_inside_free_values_are_bounded(grammar):
    assert not DIGITS & grammar({"type": "object"}, '{"k": ' + "1" * 17)
    assert not DIGITS & grammar({"type": "object"}, '{"k": [1, ' + "2" * 17)
    assert completes(grammar, {"type": "object"}, '{"k": [1, -2.5e-7, {"z": 1234567890123456}]}')


def test_whitespace_is_fixed(grammar):
    assert grammar(AGE, "{") == {'"'}, "no space or newline after the brace"
    assert grammar(AGE, '{"age":') == {" "}
    assert " " not in grammar(AGE, '{"age": ')
    assert grammar(AGE, '{"age": 5') == set(DIGITS) | {"}"}


def test_bound_schema_adds_only_missing_bounds():
    from kvboost_hf.server.decoding.json_bounds import bound_schema

    schema = {"type": "object", "$defs": {"N": {"type": ["integer", "null"]}},
              "properties": {"a": {"$ref": "#/$defs/N"},
                             "b": {"anyOf": [{"type": "integer", "exclusiveMinimum": 0}, {"type": "string"}]},
                             "c": {"type": "number", "maximum": 5},
                             "d": {"type": "number"},
                             "e": {"type": "integer", "enum": [1, 2]},
                             "f": {"type": "integer", "minimum": -1e30, "maximum": 1e30},
                             "g": {"type": ["integer", "number"], "minimum": 0}}}
    before = copy.deepcopy(schema)
    out = bound_schema(schema)
    assert schema == before, "the request's schema is not changed"
    assert out["$defs"]["N"] == {"type": ["integer", "null"], "minimum": INT64_MIN, "maximum": INT64_MAX}
    assert out["properties"]["b"]["anyOf"][0] == {"type": "integer", "exclusiveMinimum": 0, "maximum": INT64_MAX}
    assert out["properties"]["c"] == {"type": "number", "maximum": 5, "minimum": -FLOAT64_MAX}
    assert out["properties"]["d"] == {"type": "number"}, "two open sides: the digit-bounded number rule"
    assert out["properties"]["e"] == before["properties"]["e"]
    assert out["properties"]["f"] == before["properties"]["f"], "a bound the schema gives is kept"
    assert out["properties"]["g"] == before["properties"]["g"], "xgrammar takes no float64 bound on integers"


def test_multiple_of_keeps_its_enforcement():
    """xgrammar drops ``multipleOf`` once a range is given: no bound is added to it, and a schema giving both is
    refused (it would let through values the schema rejects)."""
    from kvboost_hf.server.decoding.json_bounds import bound_schema
    from kvboost_hf.server.decoding.schema_support import unsupported_construct

    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}, "required": ["n"]}
    assert bound_schema(schema) == schema
    assert unsupported_construct(schema) is None
    ranged = {"type": "integer", "multipleOf": 3, "minimum": 0}
    assert "multipleOf" in unsupported_construct(ranged)
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(["<eos>", "a"], stop_token_ids=[0]))
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(ranged), any_whitespace=False))
    assert matcher.accept_string("7") and matcher.accept_token(0), "xgrammar now enforces it: stop refusing"


def test_multiple_of_is_enforced_by_the_mask(grammar):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}, "required": ["n"]}
    assert completes(grammar, schema, '{"n": 12}')
    assert "}" not in grammar(schema, '{"n": 13')
