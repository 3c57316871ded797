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

import torch
from transformers import LogitsProcessor

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


class GrammarMask(LogitsProcessor):
    """Masks every token the grammar does not allow next (one xgrammar matcher per batch row).

    Like xgrammar's own ``contrib.hf.LogitsProcessor``, plus: a row whose grammar has ended
    allows only its stop tokens, and a vocabulary that cannot continue the grammar raises a
    ``RuntimeError`` saying so instead of silently sampling from an all ``-inf`` row.
    """

    def __init__(self, compiled) -> None:
        self.compiled = compiled
        self.matchers: list = []
        self.bitmask = None
        self.steps = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        import xgrammar as xgr

        if not self.matchers:
            self.matchers = [xgr.GrammarMatcher(self.compiled) for _ in range(input_ids.shape[0])]
            self.bitmask = xgr.allocate_token_bitmask(input_ids.shape[0], self.compiled.tokenizer_info.vocab_size)
        elif self.steps:
            for row, matcher in enumerate(self.matchers):
                if not matcher.is_terminated() and not matcher.accept_token(int(input_ids[row, -1])):
                    token = int(input_ids[row, -1])
                    raise RuntimeError(f"token {token} breaks the grammar (a processor after the mask changed the choice?)")
        self.steps += 1
        for row, matcher in enumerate(self.matchers):
            if not matcher.is_terminated():  # a finished row keeps its last mask (its stop tokens)
                matcher.fill_next_token_bitmask(self.bitmask, row)
        masked = scores.to("cpu", copy=True)
        xgr.apply_token_bitmask_inplace(masked, self.bitmask)
        if torch.isneginf(masked).all(dim=-1).any():
            raise RuntimeError("no token of this vocabulary can continue the grammar "
                               "(the tokenizer cannot spell JSON?)")
        return masked.to(scores.device)


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
