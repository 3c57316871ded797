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


def test_bad_structured_output_requests_are_400_with_the_param(tiny_server):
    tool = {"type": "function", "function": {"name": "pick", "parameters": {"type": "object"}}}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": "not an object"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tools": [tool], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        ({"tools": [tool], "functions": [tool["function"]]}, "functions"),
    ]
    for extra, param in cases:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": words(12)}], "max_tokens": 2, **extra}
        response = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == param, (extra, response.json())


def test_tool_choice_none_and_auto_without_a_call_answer_text(tiny_server):
    tool = {"type": "function", "function": {"name": "pick", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": words(12)}]
    client = tiny_server.client()
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
    for choice in ("none", "auto"):
        out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0,
                                             tools=[tool], tool_choice=choice)
        assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")
        assert out.choices[0].message.content
    none = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0,
                                          tools=[tool], tool_choice="none")
    assert none.choices[0].message.content == plain.choices[0].message.content  # "none": tools stay out of the prompt


def test_chat_message_has_no_tool_calls_key_without_calls(tiny_server):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": words(12)}], "max_tokens": 2}
    message = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json=body, timeout=30).json()["choices"][0]["message"]
    assert message["role"] == "assistant" and "tool_calls" not in message and isinstance(message["content"], str)


def test_a_template_that_renders_tools_gets_them_through_tools_kwarg():
    """Templates that know tools get ``tools=`` (here each tool adds the word w9 and a tool turn w8)."""
    from tests.conftest import make_tiny
    from tests.server.conftest import serve, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{{ bos_token }} {% for t in tools or [] %}w9 {% endfor %}"
        "{% for m in messages %}{{ {'system': 'w3', 'user': 'w4', 'assistant': 'w5', 'tool': 'w8'}[m['role']] }} "
        "{{ m['content'] or '' }} {% endfor %}{% if add_generation_prompt %}w5{% endif %}"
    )
    tool = {"type": "function", "function": {"name": "pick", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": words(12)}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "pick", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": words(13)}]
    with serve(make_tiny("llama", seed=2), tokenizer) as server:
        client = server.client()
        without = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
        with_tools = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1,
                                                    tools=[tool, {**tool, "function": {"name": "other"}}])
    assert with_tools.usage.prompt_tokens == without.usage.prompt_tokens + 2  # w9 per tool, from the template
    # the tool turn reached the template as role "tool" (w8), not rewritten as a user turn
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert without.usage.prompt_tokens == len(expected["input_ids"])
