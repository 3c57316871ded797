"""Grammar-constrained decoding for ``response_format`` and forced tool calls, with xgrammar.

xgrammar (the structured-output library vLLM and SGLang use) compiles a JSON schema against the
model's vocabulary into a token mask; its transformers ``LogitsProcessor`` masks every step of
``model.generate``, so what comes out is guaranteed to parse and to match the schema (unless
``max_tokens`` cuts it short: then ``finish_reason`` is ``"length"``). The vocabulary info is
built once per tokenizer (about a second for Gemma's 262k tokens) and compiled grammars are
cached by xgrammar's compiler.

JSON is compiled without free whitespace (``any_whitespace=False``): a base model left to pick
whitespace can emit newlines until ``max_tokens``.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from .grammar_mask import GrammarMask

logger = logging.getLogger(__name__)

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


class GrammarCompilers:
    """One xgrammar ``GrammarCompiler`` per tokenizer (thread safe; built on first use)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._compilers: dict[int, Any] = {}

    def compiler(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        import xgrammar as xgr

        with self._lock:
            compiler = self._compilers.get(id(tokenizer))
            if compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
                compiler = self._compilers[id(tokenizer)] = xgr.GrammarCompiler(info)
            return compiler

    def json_processor(self, tokenizer, vocab_size: int, stop_ids: list[int], schema: dict[str, Any]) -> GrammarMask:
        """A fresh logits processor (one per generate call) that allows only JSON matching ``schema``."""
        import xgrammar as xgr

        compiler = self.compiler(tokenizer, vocab_size, stop_ids)
        try:
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        except (RuntimeError, ValueError, xgr.InvalidJSONError) as err:
            raise ValueError(f"the JSON schema cannot be compiled into a grammar: {err}") from None
        return GrammarMask(compiled)


def response_format_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema a ``response_format`` asks for: None for ``text``; raises ``ValueError`` when malformed."""
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_JSON_OBJECT
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError("response_format.json_schema must be an object with a 'schema' object")
        return spec.get("schema") or ANY_JSON_OBJECT
    raise ValueError(f"response_format type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'")
