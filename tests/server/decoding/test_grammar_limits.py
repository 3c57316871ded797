"""What a client's JSON schema can cost the server, and what a structured reply guarantees.

Grammar compiles are bounded (a thread of their own, a timeout, a number in flight, a cache size)
and never run where generation runs (either scheduler); a structured reply is a complete object
even with stop strings; schemas the grammar cannot enforce exactly are refused before generation.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import jsonschema
import pytest
import xgrammar as xgr

from kvboost_hf import ChunkStore
from kvboost_hf.server.api.errors import APIError
from kvboost_hf.server.decoding.structured import GrammarCompilers
from tests.conftest import VOCAB, make_tiny
from tests.server.conftest import MODEL_NAME, serve
from tests.server.decoding.test_grammar_mask import SCHEMA, char_tokenizer

COMPILE_THREAD = "kvboost-grammar-compile"


def json_tokenizer():
    """The 96-piece character vocabulary, decoding pieces joined (so replies parse), with a chat template."""
    from tokenizers import decoders

    tokenizer = char_tokenizer()
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tokenizer


@pytest.fixture(scope="module", params=["workers", "batch"])
def json_server(request):
    with serve(make_tiny("llama", seed=3), json_tokenizer(), ChunkStore(max_bytes=50_000_000, chunk_size=16),
               scheduler=request.param) as running:
        yield running


def chat(server, **kw) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 60,
            "temperature": 0, **kw}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)


def assert_400(response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# ---------------------------------------------------------------------------- compiles
def test_schemas_compile_on_a_thread_of_their_own_never_where_generation_runs(json_server, monkeypatch):
    threads: list[str] = []
    original = xgr.GrammarCompiler.compile_grammar

    def recording(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(xgr.GrammarCompiler, "compile_grammar", recording)
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "n": {"type": "integer", "maximum": 7}}}
    for _ in range(2):
        out = chat(json_server, response_format=fmt(schema))
        assert out.status_code == 200, out.text
        jsonschema.validate(json.loads(out.json()["choices"][0]["message"]["content"]), schema)
    assert threads and set(threads) == {COMPILE_THREAD}, threads


def blocked_compiles(monkeypatch) -> tuple[threading.Event, list[str]]:
    """Make every compile wait for the returned event (bounded), recording each schema compiled."""
    release, compiled = threading.Event(), []

    def slow(compiler, text):
        compiled.append(text)
        release.wait(30)
        return f"grammar of {text}"

    monkeypatch.setattr(GrammarCompilers, "_compile", staticmethod(slow))
    monkeypatch.setattr(GrammarCompilers, "compiler", lambda self, *args: object())
    return release, compiled


def test_a_compile_past_the_timeout_is_refused_and_the_schema_is_refused_again_at_once(monkeypatch):
    release, compiled = blocked_compiles(monkeypatch)
    grammars = GrammarCompilers(timeout_s=0.2, max_compiling=2)

    async def scenario():
        with pytest.raises(ValueError, match="longer than 0.2 s"):
            await grammars.compile(None, VOCAB, [2], {"type": "string"})
        with pytest.raises(ValueError, match="longer than 0.2 s"):  # not compiled a second time
            await grammars.compile(None, VOCAB, [2], {"type": "string"})
        release.set()
        assert await grammars.compile(None, VOCAB, [2], {"type": "integer"}) == 'grammar of {"type": "integer"}'

    try:
        asyncio.run(scenario())
    finally:
        release.set()
    assert compiled == ['{"type": "string"}', '{"type": "integer"}']


def test_compiles_in_flight_are_bounded_and_requests_share_one_compile(monkeypatch):
    """One slot: two requests for one schema share its compile; an abandoned compile keeps its slot until it
    really ends (xgrammar cannot cancel it), so a third request gets 503 instead of another thread."""
    release, compiled = blocked_compiles(monkeypatch)
    grammars = GrammarCompilers(timeout_s=0.3, max_compiling=1)

    async def scenario():
        first = asyncio.ensure_future(grammars.compile(None, VOCAB, [2], {"type": "string"}))
        same = asyncio.ensure_future(grammars.compile(None, VOCAB, [2], {"type": "string"}))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as busy:
            await grammars.compile(None, VOCAB, [2], {"type": "boolean"})
        assert busy.value.status == 503 and busy.value.code == "grammar_compiler_busy"
        for task in (first, same):
            with pytest.raises(ValueError, match="longer than"):
                await task
        alive = [t for t in threading.enumerate() if t.name == COMPILE_THREAD]
        release.set()
        for _ in range(200):  # the abandoned compile ends and gives its slot back (bounded wait)
            if not any(t.name == COMPILE_THREAD for t in threading.enumerate()):
                break
            await asyncio.sleep(0.01)
        return alive, await grammars.compile(None, VOCAB, [2], {"type": "boolean"})

    try:
        alive, later = asyncio.run(scenario())
    finally:
        release.set()
    assert len(alive) == 1 and later == 'grammar of {"type": "boolean"}'
    assert compiled == ['{"type": "string"}', '{"type": "boolean"}']


def test_the_grammar_cache_is_bounded():
    grammars = GrammarCompilers(cache_bytes=3_000_000)
    compiler = grammars.compiler(json_tokenizer(), VOCAB, [2])
    assert compiler.cache_limit_bytes == 3_000_000
    for n in range(40):
        compiler.compile_json_schema(json.dumps({"type": "string", "maxLength": 200 + n}), any_whitespace=False)
    assert 0 < compiler.get_cache_size_bytes() <= 3_000_000 * 1.1


def test_compile_limits_are_server_settings_and_serve_flags():
    import argparse

    from kvboost_hf.server.command import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--grammar-cache", "64MiB", "--grammar-compile-timeout", "2.5",
                              "--grammar-compile-slots", "3", "--max-body-size", "1MiB"])
    assert (args.grammar_cache, args.grammar_compile_timeout, args.grammar_compile_slots, args.max_body_size) == \
        ("64MiB", 2.5, 3, "1MiB")
    with serve(make_tiny("llama", seed=3), json_tokenizer(), grammar_cache_bytes=64 * 2**20,
               grammar_compile_timeout=2.5, grammar_compile_slots=3) as running:
        grammars = running.app.state.service.grammars
        assert (grammars.cache_bytes, grammars.timeout_s, grammars.max_compiling) == (64 * 2**20, 2.5, 3)


@pytest.mark.gemma
def test_a_schema_that_compiles_for_seconds_on_gemma_is_a_400(gemma):
    """A 56-byte schema whose grammar takes 4-6 s to compile against Gemma's 262k-token vocabulary."""
    model, tokenizer = gemma
    slow = {"type": "string", "minLength": 2000, "maxLength": 5000}
    with serve(model, tokenizer, ChunkStore(max_bytes=400_000_000, chunk_size=32), model_name=MODEL_NAME,
               grammar_compile_timeout=0.5) as running:
        for _ in range(2):  # the second time it is refused without compiling again
            out = chat(running, response_format=fmt(slow), max_tokens=4)
            assert out.status_code == 400, out.text
            error = out.json()["error"]
            assert error["param"] == "response_format" and "longer than 0.5 s" in error["message"]
        assert chat(running, max_tokens=2).status_code == 200


# ---------------------------------------------------------------------------- structured replies
def test_stop_strings_never_cut_a_structured_reply(json_server):
    """Every reply of this schema has commas: a stop at "," used to cut it mid-object (finish "stop")."""
    out = chat(json_server, response_format=fmt(SCHEMA), stop=[",", '"'])
    assert out.status_code == 200, out.text
    choice = out.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    plain = chat(json_server, stop=["x0"])  # stop strings still cut unconstrained replies
    assert plain.status_code == 200


OVERLAPPING = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
DISCRIMINATED = {
    "type": "object", "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}},
    "required": ["pet"],
    "$defs": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "id": {"type": "integer",
                                                                                         "maximum": 9}},
                      "required": ["kind", "id"]},
              "Dog": {"type": "object", "properties": {"kind": {"const": "dog"}, "id": {"type": "integer",
                                                                                         "maximum": 9}},
                      "required": ["kind", "id"]}},
}


def test_schemas_the_grammar_cannot_enforce_exactly_are_refused_before_generation(json_server):
    out = chat(json_server, response_format=fmt({"type": "object", "properties": {"v": OVERLAPPING},
                                                 "required": ["v"]}))
    assert out.status_code == 400, out.text
    error = out.json()["error"]
    assert error["param"] == "response_format" and error["code"] == "unsupported_schema"
    assert "oneOf" in error["message"] and "#/properties/v" in error["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "not": {"const": 3}}}, "required": ["a"]}}}
    forced = chat(json_server, tools=[tool], tool_choice="required")
    assert forced.status_code == 400 and forced.json()["error"]["param"] == "tools"
    fine = chat(json_server, response_format=fmt(DISCRIMINATED))
    assert fine.status_code == 200, fine.text
    content = fine.json()["choices"][0]["message"]["content"]
    if fine.json()["choices"][0]["finish_reason"] == "stop":
        jsonschema.validate(json.loads(content), DISCRIMINATED)


@pytest.mark.parametrize("schema", [{"$ref": "#"},
                                    {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}},
                                     "$ref": "#/$defs/A"}])
def test_a_schema_that_admits_no_value_is_a_400(json_server, schema):
    """It used to fail at the first step with a 500 ("no token of this vocabulary can continue the grammar")."""
    error = assert_400(chat(json_server, response_format=fmt(schema)), "response_format")
    assert "admits no value" in error["message"]

