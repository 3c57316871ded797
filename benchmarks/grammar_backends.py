"""xgrammar (the server's grammar backend) against llguidance on Gemma-3-270M's 262k vocabulary.

Per backend, in one process, interleaved: import time (a fresh interpreter, median of 5), the
vocabulary table, compiling each schema below (caches off, median of 3), the mask cost per token
while a valid reply is fed token by token (fill the next-token mask, then accept the token), and
coverage: which constructs the server refuses as not enforced exactly (``schema_support``) each
backend enforces (a value the schema rejects is refused by the grammar).

llguidance is not a dependency: ``pip install --target /tmp/llg llguidance`` and run
``PYTHONPATH=/tmp/llg python benchmarks/grammar_backends.py``. Prints a table; writes nothing.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

SCHEMAS = {
    "person (test_structured)": {
        "type": "object", "properties": {
            "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}},
        "required": ["name", "age", "color"], "additionalProperties": False},
    "name + age (pydantic)": {"properties": {"name": {"title": "Name", "type": "string"},
                                             "age": {"title": "Age", "type": "integer"}},
                              "required": ["name", "age"], "title": "Person", "type": "object"},
    "array of records": {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "price": {"type": "number"}},
        "required": ["name", "price"]}}}, "required": ["items"]},
    "long string (maxLength 5000)": {"type": "string", "minLength": 2000, "maxLength": 5000},
}
REPLY = {"person (test_structured)": {"name": "Ada Lovelace", "age": 36, "color": "green", "tags": ["math"]},
         "name + age (pydantic)": {"name": "Ada Lovelace", "age": 36},
         "array of records": {"items": [{"name": "apples", "price": 1.25}, {"name": "bread", "price": 2.5}]}}
OBJ_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
REFUSED = {  # (schema, a value it rejects), as in tests/server/decoding/test_schema_support.py
    "oneOf overlapping": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, 5),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, 1),
    "not": ({"type": "integer", "not": {"const": 5}}, 5),
    "if/then": ({**OBJ_AB, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, {"a": 1}),
    "dependentRequired": ({**OBJ_AB, "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2, 1]),
    "multipleOf on a number": ({"type": "number", "multipleOf": 0.5}, 0.3),
}


def import_seconds(module: str) -> float:
    times = []
    for _ in range(5):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def run(self, compiled, tokens: list[int]) -> None:
        matcher = self.xgr.GrammarMatcher(compiled)
        for token in tokens:
            matcher.fill_next_token_bitmask(self.bitmask)
            assert matcher.accept_token(token)

    def accepts(self, schema: dict, text: str) -> bool | str:
        compiled = self.xgr.GrammarCompiler(self.xgr.TokenizerInfo(["<eos>", "a"], stop_token_ids=[0])) \
            .compile_json_schema(json.dumps(schema), any_whitespace=False)
        matcher = self.xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.accept_token(0)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)  # builds the lexer: what a compile is here
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def run(self, grammar, tokens: list[int]) -> None:
        import llguidance.torch

        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        for token in tokens:
            llguidance.torch.fill_next_token_bitmask(matcher, self.bitmask, 0)
            assert matcher.consume_token(token), matcher.get_error()

    def accepts(self, schema: dict, text: str) -> bool | str:
        try:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        except Exception as err:  # noqa: BLE001 - the schema is refused
            return f"refused ({str(err)[:60]})"
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            return f"refused ({matcher.get_error()[:60]})"
        tokens = self.tokenizer.tokenize_str(text)
        return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


def main() -> None:
    from transformers import AutoConfig, AutoTokenizer

    from kvboost_hf.models import default_model_path

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab_size = AutoConfig.from_pretrained(path).vocab_size
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    print(f"import xgrammar {import_seconds('xgrammar'):.2f} s, import llguidance "
          f"{import_seconds('llguidance; import llguidance.hf; import llguidance.torch'):.2f} s (fresh interpreter)")
    backends = []
    for cls in (XGrammar, LLGuidance):
        start = time.perf_counter()
        backends.append(cls(tokenizer, vocab_size, eos))
        print(f"{cls.name}: vocabulary table {time.perf_counter() - start:.2f} s")
    for name, schema in SCHEMAS.items():
        row = []
        for backend in backends:
            times = []
            for _ in range(3):
                start = time.perf_counter()
                try:
                    compiled = backend.compile(schema)
                except Exception as err:  # noqa: BLE001 - reported as a row
                    times, compiled = [], f"error: {err}"[:80]
                    break
                times.append(time.perf_counter() - start)
            cell = f"compile {statistics.median(times) * 1000:.0f} ms" if times else compiled
            if times and name in REPLY:
                tokens = tokenizer(json.dumps(REPLY[name]), add_special_tokens=False)["input_ids"]
                per_token = []
                for _ in range(5):
                    start = time.perf_counter()
                    backend.run(compiled, tokens)
                    per_token.append((time.perf_counter() - start) / len(tokens))
                cell += f", {statistics.median(per_token) * 1000:.2f} ms/token ({len(tokens)} tokens)"
            row.append(f"{backend.name}: {cell}")
        print(f"{name:30s} " + " | ".join(row))
    for name, (schema, value) in REFUSED.items():
        cells = []
        for backend in backends:
            verdict = backend.accepts(schema, json.dumps(value))
            cells.append(f"{backend.name}: " + (verdict if isinstance(verdict, str) else
                                                  "not enforced" if verdict else "enforced"))
        print(f"{name:30s} " + " | ".join(cells))


if __name__ == "__main__":
    main()
