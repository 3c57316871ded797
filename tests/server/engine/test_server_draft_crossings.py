"""A served draft crossed with structured output, forced tool calls, stop strings and seeds, on the real
Gemma-3-270M (worker scheduler, where speculation runs).

Before: every json_schema / json_object request and forced tool call with a draft got 500 "token N
breaks the grammar"; stop strings let a draft run on (and ``completion_tokens`` counted past the
stop); one seed gave different replies from run to run.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

import torch

from kvboost_hf import ChunkStore, ControllerSettings, last_request_stats, make_draft, make_head_draft
from kvboost_hf.speculative import set_default_draft
from tests.server.conftest import serve
from tests.server.decoding.test_structured import ADD, PERSON, WEATHER
from tests.streaming.conftest import load_awq

pytestmark = pytest.mark.gemma
NAME = "gemma"
# Draft every round: whether the adaptive controller drafts depends on measured times, not the question.
ALWAYS = ControllerSettings(adaptive=False, max_tokens=6)
DRAFTS = ("prompt-lookup", "store")


@pytest.fixture(scope="module")
def server(gemma):
    model, tokenizer = gemma
    with serve(model, tokenizer, ChunkStore(max_bytes=400_000_000, chunk_size=32), model_name=NAME,
               scheduler="workers") as running:
        yield running


def chat(server, content: str, draft=None, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 40)
    set_default_draft(server.model, draft, ALWAYS)
    try:
        return server.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}],
                                                       **kw)
    finally:
        set_default_draft(server.model, None)


def test_json_schema_and_tool_calls_with_a_draft_are_the_plain_replies(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    plain = chat(server, "Describe a person.", response_format=fmt)
    tool = dict(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    plain_call = chat(server, "What is the weather in Paris?", **tool)
    for draft, runs in (("prompt-lookup", 1), ("store", 2)):  # "store"'s second run drafts its first reply
        for _ in range(runs):
            out = chat(server, "Describe a person.", draft=draft, response_format=fmt)
            assert out.choices[0].message.content == plain.choices[0].message.content, draft
            assert out.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    call = chat(server, "What is the weather in Paris?", draft="prompt-lookup", **tool)
    assert call.choices[0].message.tool_calls[0].function.arguments == \
        plain_call.choices[0].message.tool_calls[0].function.arguments


@pytest.fixture(scope="module")
def head(server, gemma):
    """A head draft of the served Gemma: its own layers, an int8 head over the 32k most frequent tokens."""
    return make_head_draft(server.model, 32768, tokenizer=gemma[1])


def test_stop_strings_with_a_draft_end_and_count_as_plain(server, head):
    prompt = "Count: one, two, three, four, five, six, seven, eight, nine, ten. Again: one, two, three,"
    full = chat(server, prompt, max_tokens=30).choices[0].message.content
    stop = full.strip().split()[3]  # a word the reply reaches after a few tokens
    plain = chat(server, prompt, max_tokens=30, stop=[stop])
    assert plain.choices[0].finish_reason == "stop"
    for draft in (*DRAFTS, head):
        out = chat(server, prompt, draft=draft, max_tokens=30, stop=[stop])
        assert out.choices[0].message.content == plain.choices[0].message.content
        assert out.choices[0].finish_reason == "stop"
        assert out.usage.completion_tokens == plain.usage.completion_tokens, draft


def test_a_seed_decides_a_sampled_reply_with_a_draft(server, head):
    prompt = "Write a short story about a cat and a dog who become friends."
    for draft in (*DRAFTS, head):
        texts = {chat(server, prompt, draft=draft, temperature=0.9, seed=42, max_tokens=24).choices[0].message.content
                 for _ in range(2)}
        assert len(texts) == 1, (draft, texts)


@pytest.fixture(scope="module")
def int4_server(gemma, gemma_awq):
    """The embedded Gemma packed to int4 and served on kvboost_hf's kernels (fused layers, row-exact verification)."""
    model = load_awq(gemma_awq, residency_mode="full_resident", kernel="auto", dtype=torch.bfloat16)
    with serve(model, gemma[1], ChunkStore(max_bytes=400_000_000, chunk_size=32), model_name=NAME,
               scheduler="workers") as running:
        yield running


def test_an_int4_model_with_its_int4_self_draft_gives_the_plain_structured_reply(int4_server, gemma):
    """The server's combination for `--draft int4` (or `--draft head`) on an int4 checkpoint with a response_format:
    the draft's rounds pass the grammar and the target's row-exact verification and change no token."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    # room for the whole object (the schema bounds it): how long the reply runs depends on the ISA path's bits
    plain = chat(int4_server, "Describe a person.", response_format=fmt, max_tokens=120)
    assert plain.choices[0].finish_reason == "stop"
    draft = make_draft(int4_server.model, bits=4)
    head = make_head_draft(int4_server.model, 32768, tokenizer=gemma[1])
    for draft_kind in (draft, head, "prompt-lookup"):
        out = chat(int4_server, "Describe a person.", draft=draft_kind, response_format=fmt, max_tokens=120)
        assert out.choices[0].message.content == plain.choices[0].message.content, draft_kind
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
        if not isinstance(draft_kind, str):
            assert last_request_stats(int4_server.model).speculation.drafted_tokens > 0
