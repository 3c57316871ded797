"""Completion prompts without the ``<bos>`` their model needs keep their ids and get a warning header
(and one log line per server); text prompts get ``<bos>`` from the tokenizer and no header."""

from __future__ import annotations

import logging

import httpx
import pytest

from kvboost_hf import ChunkStore
from kvboost_hf.server.decoding.bos import BOS_WARNING_HEADER, bos_needed
from tests.conftest import make_tiny
from tests.server.conftest import serve, tiny_tokenizer

TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def gemma_bos_server(gemma):
    with serve(gemma[0], gemma[1], ChunkStore(max_bytes=100_000_000, chunk_size=16), model_name="gemma") as server:
        yield server


def complete(server, prompt, **extra) -> httpx.Response:
    body = {"model": "gemma", "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply


def test_needs_bos_is_read_from_the_tokenizer(gemma):
    assert bos_needed(gemma[1]) == gemma[1].bos_token_id == gemma[1](TEXT)["input_ids"][0]
    assert bos_needed(tiny_tokenizer()) is None  # the word tokenizer adds nothing


def test_token_prompt_without_bos_keeps_its_ids_and_gets_the_header(gemma, gemma_bos_server, caplog):
    caplog.set_level(logging.WARNING, logger="kvboost_hf.server.decoding.bos")
    tokenizer = gemma[1]
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    reply = complete(gemma_bos_server, ids, echo=True, logprobs=0)
    warning = reply.headers[BOS_WARNING_HEADER]
    assert "prompt 0 does not start with <bos>" in warning and "add_bos_token=True" in warning
    assert reply.json()["usage"]["prompt_tokens"] == len(ids)  # nothing prepended
    listed = complete(gemma_bos_server, [[tokenizer.bos_token_id, *ids], ids])  # only the second lacks it
    assert listed.headers[BOS_WARNING_HEADER].startswith("prompt 1 does not start with <bos>")
    streamed = httpx.post(f"{gemma_bos_server.base_url}/v1/completions", timeout=120,
                          json={"model": "gemma", "prompt": ids, "max_tokens": 1, "stream": True})
    assert streamed.status_code == 200 and BOS_WARNING_HEADER in streamed.headers
    records = [r for r in caplog.records if r.name == "kvboost_hf.server.decoding.bos"]
    assert len(records) == 1 and "does not start with <bos>" in records[0].getMessage()


def test_prompts_with_one_bos_get_no_header(gemma, gemma_bos_server):
    tokenizer = gemma[1]
    text = complete(gemma_bos_server, TEXT)
    assert BOS_WARNING_HEADER not in text.headers
    assert text.json()["usage"]["prompt_tokens"] == len(tokenizer(TEXT)["input_ids"])
    ids = tokenizer(TEXT)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert BOS_WARNING_HEADER not in complete(gemma_bos_server, ids).headers


def test_text_starting_with_bos_is_flagged_as_doubled(gemma_bos_server):
    reply = complete(gemma_bos_server, "<bos>" + TEXT)
    assert "starts with <bos> twice" in reply.headers[BOS_WARNING_HEADER]


def test_tokenizer_info_says_whether_bos_is_added(gemma_bos_server):
    info = httpx.get(f"{gemma_bos_server.base_url}/tokenizer_info", timeout=30).json()
    assert info["add_bos_token"] is True and info["bos_token"] == "<bos>"


def test_model_that_needs_no_bos_gets_no_header():
    with serve(make_tiny("llama", seed=5), tiny_tokenizer()) as server:
        reply = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1})
        info = httpx.get(f"{server.base_url}/tokenizer_info", timeout=30).json()
    assert reply.status_code == 200 and BOS_WARNING_HEADER not in reply.headers
    assert info["add_bos_token"] is False
