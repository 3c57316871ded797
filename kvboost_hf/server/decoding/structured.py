"""Grammar-constrained decoding for ``response_format`` and forced tool calls, with xgrammar.

xgrammar (the structured-output library vLLM and SGLang use) compiles a JSON schema against the
model's vocabulary into a token mask; its transformers ``LogitsProcessor`` masks every step of
``model.generate``, so what comes out is guaranteed to parse and to match the schema (unless
``max_tokens`` cuts it short: then ``finish_reason`` is ``"length"``). The vocabulary info is
built once per tokenizer (about a second for Gemma's 262k tokens).

A client chooses the schema, and compiling one can take seconds of CPU (a string with
``maxLength`` 5000 takes 4-6 s against Gemma's vocabulary), so :meth:`GrammarCompilers.compile`
compiles on a thread of its own, never on the event loop or a scheduler thread; refuses a schema
whose compile outlasts ``timeout_s`` (xgrammar cannot cancel one: the thread is abandoned and
finishes on its own, and the same schema is refused at once afterwards); runs at most
``max_compiling`` compiles at a time (others wait for a slot up to ``timeout_s``, then 503); and
caches compiled grammars up to ``cache_bytes``.

JSON is compiled without free whitespace (``any_whitespace=False``: separators ``", "`` and
``": "``, nothing else), since a base model left to pick whitespace can emit newlines until
``max_tokens``, and with numbers bounded to what parsers hold (int64 integers, float64 digits:
:mod:`.json_bounds`), since one left to pick digits can write ``30000000...`` until then.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

from starlette.concurrency import run_in_threadpool

from kvboost_hf.server.api.errors import APIError
from kvboost_hf.server.decoding.grammar_mask import GrammarMask
from kvboost_hf.server.decoding.json_bounds import json_grammar_ebnf
from kvboost_hf.server.settings import (
    DEFAULT_GRAMMAR_CACHE_BYTES,
    DEFAULT_GRAMMAR_COMPILE_SLOTS,
    DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
)

logger = logging.getLogger(__name__)

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
_REMEMBERED_REFUSALS = 1024  # schemas refused for compiling too slowly, refused again without compiling
_SLOT_POLL_S = 0.02


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class GrammarCompilers:
    """One xgrammar ``GrammarCompiler`` per tokenizer (thread safe; built on first use), with bounds.

    ``cache_bytes`` bounds each compiler's cache of compiled grammars (xgrammar evicts the least
    recently used); ``timeout_s`` bounds how long a request waits for a compile (and for a free
    slot); ``max_compiling`` bounds the compiles running at once, abandoned ones included. Each
    compile uses ``cores // max_compiling`` threads (at least 1, at most 8), so compiling never
    takes more than the machine's cores.
    """

    def __init__(self, cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES,
                 timeout_s: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
                 max_compiling: int = DEFAULT_GRAMMAR_COMPILE_SLOTS) -> None:
        if cache_bytes < 1 or not timeout_s > 0 or max_compiling < 1:
            raise ValueError(f"cache_bytes, timeout_s and max_compiling must be positive, got "
                             f"{cache_bytes!r}, {timeout_s!r}, {max_compiling!r}")
        self.cache_bytes, self.timeout_s, self.max_compiling = cache_bytes, timeout_s, max_compiling
        self.threads = max(1, min(8, _cores() // max_compiling))
        self._lock = threading.Lock()
        self._compilers: dict[int, Any] = {}
        self._slots = threading.BoundedSemaphore(max_compiling)
        self._running: dict[tuple[int, bytes], Future] = {}  # one compile per schema, shared by its waiters
        self._refused: OrderedDict[tuple[int, bytes], str] = OrderedDict()

    def compiler(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        """The tokenizer's compiler; the first call builds its vocabulary table (seconds for a large vocabulary)."""
        import xgrammar as xgr

        with self._lock:
            compiler = self._compilers.get(id(tokenizer))
            if compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
                compiler = self._compilers[id(tokenizer)] = xgr.GrammarCompiler(
                    info, max_threads=self.threads, cache_limit_bytes=self.cache_bytes)
            return compiler

    @staticmethod
    def _compile(compiler, text: str):
        """Compile ``text``; ``ValueError`` when xgrammar refuses it, or when it admits no value at all
        (e.g. ``{"$ref": "#"}``) though the vocabulary can spell JSON."""
        import xgrammar as xgr

        try:
            compiled = compiler.compile_grammar(json_grammar_ebnf(text))
        except (RuntimeError, ValueError, xgr.InvalidJSONError) as err:
            raise ValueError(f"the JSON schema cannot be compiled into a grammar: {err}") from None
        if not _can_start(compiled) and _can_start(compiler.compile_builtin_json_grammar()):
            raise ValueError("the JSON schema admits no value (a $ref cycle without a way out?)")
        return compiled

    def json_processor(self, tokenizer, vocab_size: int, stop_ids: list[int], schema: dict[str, Any]) -> GrammarMask:
        """A fresh logits processor that allows only JSON matching ``schema``, compiled on this thread
        (for library use; the server compiles with :meth:`compile`)."""
        return GrammarMask(self._compile(self.compiler(tokenizer, vocab_size, stop_ids), json.dumps(schema)))

    async def compile(self, tokenizer, vocab_size: int, stop_ids: list[int], schema: dict[str, Any]):
        """The compiled grammar of ``schema``, compiled on a thread of its own within the bounds.

        Raises ``ValueError`` (the request's 400) for a schema xgrammar refuses or one that compiles
        longer than ``timeout_s``, and :class:`APIError` 503 when no compile slot frees in time.
        """
        compiler = await run_in_threadpool(self.compiler, tokenizer, vocab_size, stop_ids)  # once per tokenizer
        text = json.dumps(schema)
        key = (id(tokenizer), hashlib.sha256(text.encode()).digest())  # remembered keys stay small
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            refused = self._refused.get(key)
            running = self._running.get(key)
        if refused is not None:
            raise ValueError(refused)
        if running is None:  # shares a compile of the same schema that starts meanwhile
            running = await self._start(key, compiler, text, deadline)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(running)),
                                          max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
            message = (f"compiling this JSON schema into a grammar took longer than {self.timeout_s:g} s, the "
                       f"server's limit (--grammar-compile-timeout): simplify it (e.g. smaller maxLength, "
                       f"maxItems or nesting)")
            with self._lock:
                self._refused[key] = message
                while len(self._refused) > _REMEMBERED_REFUSALS:
                    self._refused.popitem(last=False)
            logger.warning("refused a JSON schema that compiles longer than %g s (%d bytes)", self.timeout_s,
                           len(text))
            raise ValueError(message) from None

    async def _start(self, key: tuple[int, bytes], compiler, text: str, deadline: float) -> Future:
        """Take a compile slot (waiting up to ``deadline``) and start compiling ``text`` on a new thread."""
        while True:
            with self._lock:
                running = self._running.get(key)  # another request may have started it while this one waited
                if running is not None:
                    return running
                if self._slots.acquire(blocking=False):
                    running = self._running[key] = Future()
                    break
            if time.monotonic() >= deadline:
                raise APIError(503, f"the server is compiling {self.max_compiling} other grammars; retry later",
                               code="grammar_compiler_busy",
                               headers={"Retry-After": str(max(1, round(self.timeout_s)))})
            await asyncio.sleep(_SLOT_POLL_S)

        def work() -> None:
            try:
                if running.set_running_or_notify_cancel():
                    try:
                        compiled = self._compile(compiler, text)
                    except BaseException as err:  # noqa: BLE001 - handed to the waiting requests
                        running.set_exception(err)
                    else:
                        running.set_result(compiled)
            finally:
                with self._lock:
                    self._running.pop(key, None)
                self._slots.release()

        threading.Thread(target=work, name="kvboost-grammar-compile", daemon=True).start()
        return running


def _can_start(compiled) -> bool:
    """Whether any token of the vocabulary may begin a value of the grammar."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


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
