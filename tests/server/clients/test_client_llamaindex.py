"""LlamaIndex ``OpenAILike`` against a real server on loopback: chat and completion, plain and streamed."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_index.llms.openai_like", reason="the [clients] extra: pip install -e '.[clients]'")
from llama_index.core.llms import ChatMessage  # noqa: E402
from llama_index.llms.openai_like import OpenAILike  # noqa: E402

from tests.server.conftest import MODEL_NAME, words  # noqa: E402


def llm(server, chat: bool) -> OpenAILike:
    return OpenAILike(model=MODEL_NAME, api_base=f"{server.base_url}/v1", api_key="unused", is_chat_model=chat,
                      context_window=512, max_tokens=5, temperature=0, max_retries=0, timeout=60)


def test_completion_and_stream(tiny_server):
    client = tiny_server.client()
    expected = client.completions.create(model=MODEL_NAME, prompt=words(20, 21), max_tokens=5, temperature=0)
    model = llm(tiny_server, chat=False)
    assert model.complete(words(20, 21)).text == expected.choices[0].text
    assert "".join(r.delta for r in model.stream_complete(words(20, 21))) == expected.choices[0].text


def test_chat_and_stream(tiny_server):
    client = tiny_server.client()
    messages = [{"role": "system", "content": words(30)}, {"role": "user", "content": words(31, 32)}]
    expected = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0)
    model = llm(tiny_server, chat=True)
    history = [ChatMessage(role=m["role"], content=m["content"]) for m in messages]
    reply = model.chat(history)
    assert reply.message.content == expected.choices[0].message.content
    assert "".join(r.delta or "" for r in model.stream_chat(history)) == expected.choices[0].message.content
