"""Structured output on the real embedded Gemma-3-270M (a base model): JSON that validates, forced tool calls.

One server for the module; every reply is checked with ``jsonschema``. Also: exact logprobs on
the real model with reuse on.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
import torch

NAME = "gemma"
pytestmark = pytest.mark.gemma
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}}}


def ask(server, content: str, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 48)
    return server.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}], **kw)


@pytest.mark.parametrize("strict", [True, False])
def test_json_schema_output_validates(gemma_server, strict):
    out = ask(gemma_server, "Describe a person.", response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


def test_an_unbounded_integer_field_ends_on_the_base_model(gemma_server):
    """{"name": str, "age": int} as pydantic writes it: the base model's greedy age runs to int64's 19
    digits and stops there (it ran on until max_tokens before integers were bounded)."""
    schema = {"properties": {"name": {"title": "Name", "type": "string"}, "age": {"title": "Age", "type": "integer"}},
              "required": ["name", "age"], "title": "Person", "type": "object"}
    out = ask(gemma_server, "Give the name and age of a baker from Lyon.", max_tokens=80, response_format={
        "type": "json_schema", "json_schema": {"name": "Person", "schema": schema, "strict": True}})
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    reply = json.loads(out.choices[0].message.content)
    jsonschema.validate(reply, schema)
    assert -(2**63) <= reply["age"] < 2**63


def test_json_object_is_an_object_even_when_sampled(gemma_server):
    out = ask(gemma_server, "Some JSON please.", response_format={"type": "json_object"}, temperature=0.8, seed=3,
              max_tokens=64, n=2)
    for choice in out.choices:
        if choice.finish_reason == "stop":  # a sampled object may run past max_tokens: then it is cut short
            assert isinstance(json.loads(choice.message.content), dict)
    assert any(c.finish_reason == "stop" for c in out.choices)


def test_forced_and_named_tool_calls(gemma_server):
    required = ask(gemma_server, "What is the weather in Paris?", tools=[WEATHER, ADD], tool_choice="required")
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    schema = {"get_weather": WEATHER, "add": ADD}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    named = ask(gemma_server, "What is the weather in Paris?", tools=[WEATHER, ADD],
                tool_choice={"type": "function", "function": {"name": "add"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "add" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])


def test_tool_results_go_back_into_the_prompt(gemma_server):
    """A full round: the assistant's call and the tool's result in the history, then a final answer."""
    messages = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    out = gemma_server.client().chat.completions.create(model=NAME, messages=messages, tools=[ADD], max_tokens=6,
                                                        temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tokens = httpx.post(f"{gemma_server.base_url}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    text = gemma_server.tokenizer.decode(tokens)
    assert '<tool_response>5</tool_response>' in text and '"name": "add"' in text


def test_streamed_tool_call(gemma_server):
    body = {"model": NAME, "messages": [{"role": "user", "content": "Add 4 and 5."}], "max_tokens": 40,
            "temperature": 0, "stream": True, "tools": [ADD], "tool_choice": "required"}
    response = httpx.post(f"{gemma_server.base_url}/v1/chat/completions", json=body, timeout=300)
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["index"] == 0 and calls[0][0]["function"]["name"] == "add"
    jsonschema.validate(json.loads(calls[0][0]["function"]["arguments"]), ADD["function"]["parameters"])
    assert deltas[-1] == {} and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_gemma_logprobs_exact_with_reuse(gemma_server):
    client, model, tokenizer = gemma_server.client(), gemma_server.model, gemma_server.tokenizer
    shared = "The history of the printing press begins in the fifteenth century, when " * 4
    client.completions.create(model=NAME, prompt=shared + "movable type", max_tokens=1, temperature=0)
    prompt = shared + "a goldsmith"
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    assert out.usage.prompt_tokens_details.cached_tokens >= 32
    ids = tokenizer(prompt)["input_ids"]
    generated = tokenizer(prompt + out.choices[0].text, add_special_tokens=True)["input_ids"][len(ids):]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + generated]), use_cache=False).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    lp = out.choices[0].logprobs
    for i, token in enumerate(generated[: len(lp.token_logprobs)]):
        assert abs(lp.token_logprobs[i] - ref[len(ids) - 1 + i, token].item()) < 1e-4


def test_legacy_functions_are_tools(gemma_server):
    body = {"model": NAME, "messages": [{"role": "user", "content": "Add 1 and 2."}], "max_tokens": 24,
            "temperature": 0, "functions": [ADD["function"]], "function_call": {"name": "add"}}
    out = httpx.post(f"{gemma_server.base_url}/v1/chat/completions", json=body, timeout=300).json()
    call = out["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "add" and out["choices"][0]["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(call["function"]["arguments"]), ADD["function"]["parameters"])
