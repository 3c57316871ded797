"""Stream chunk shapes as OpenAI sends them: no ``usage`` unless asked, ``{}`` as the closing delta."""

from __future__ import annotations

import json

import httpx

from tests.server.conftest import MODEL_NAME, words


def events(base: str, route: str, body: dict) -> list[dict]:
    response = httpx.post(f"{base}{route}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    lines = [line for line in response.text.splitlines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_chat_stream_shapes(tiny_server):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": words(12)}], "max_tokens": 4,
            "temperature": 0, "stream": True}
    chunks = events(tiny_server.base_url, "/v1/chat/completions", body)
    assert all("usage" not in c for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(set(d) == {"content"} for d in deltas[1:-1])
    assert deltas[-1] == {} and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    with_usage = events(tiny_server.base_url, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in with_usage[:-1])
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"]["completion_tokens"] >= 1


def test_completion_stream_shapes_and_echo(tiny_server):
    body = {"model": MODEL_NAME, "prompt": words(12, 13), "max_tokens": 3, "temperature": 0, "stream": True,
            "echo": True, "logprobs": 1}
    chunks = events(tiny_server.base_url, "/v1/completions", body)
    assert all("usage" not in c and c["object"] == "text_completion" for c in chunks)
    assert chunks[0]["choices"][0]["text"] == words(12, 13)  # echo first
    full = httpx.post(f"{tiny_server.base_url}/v1/completions", json={**body, "stream": False}, timeout=60).json()
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["logprobs"] == full["choices"][0]["logprobs"]


def test_a_vocabulary_that_cannot_spell_json_fails_clearly(tiny_server):
    """The word-level tiny tokenizer has no '{': the grammar mask says so instead of sampling garbage."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": words(12)}], "max_tokens": 5,
            "response_format": {"type": "json_object"}}
    response = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 500 and "can continue the grammar" in response.json()["error"]["message"]
    ok = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", timeout=60, json={**body, "response_format": None})
    assert ok.status_code == 200
