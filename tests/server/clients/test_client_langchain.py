"""LangChain against a real server on loopback: ``ChatOpenAI`` (tools, structured output in every
mode, batch) on the real Gemma-3-270M, and the completions ``OpenAI`` LLM's ``batch``."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

pytest.importorskip("langchain_openai", reason="the [clients] extra: pip install -e '.[clients]'")
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI, OpenAI  # noqa: E402

from tests.server.conftest import MODEL_NAME, words  # noqa: E402


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"sunny in {city}"


def chat_model(server, max_tokens: int = 40) -> ChatOpenAI:
    return ChatOpenAI(model="gemma", base_url=f"{server.base_url}/v1", api_key="unused", temperature=0,
                      max_tokens=max_tokens, max_retries=0, timeout=300)


@pytest.mark.gemma
def test_bind_tools_returns_parsed_tool_calls(gemma_server):
    llm = chat_model(gemma_server).bind_tools([get_weather], tool_choice="required")
    message = llm.invoke("What is the weather in Oslo?")
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["id"].startswith("call_")
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert get_weather.invoke(call["args"]).startswith("sunny in")  # the args fit the tool's own signature


@pytest.mark.gemma
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_a_valid_pydantic_object(gemma_server, method):
    person = chat_model(gemma_server).with_structured_output(Person, method=method).invoke("Describe a person.")
    assert isinstance(person, Person)  # pydantic validated every field
    assert 0 <= person.age <= 120 and len(person.name) <= 16


@pytest.mark.gemma
def test_with_structured_output_json_mode(gemma_server):
    schema = {"title": "Answer", "type": "object", "properties": {"answer": {"type": "string"}}}
    llm = chat_model(gemma_server, max_tokens=80)
    out = llm.with_structured_output(schema, method="json_mode").invoke("Give me JSON.")
    assert isinstance(out, dict)


@pytest.mark.gemma
def test_chat_batch_matches_single_invokes(gemma_server):
    llm = chat_model(gemma_server, max_tokens=6)
    prompts = ["The capital of France is", "One, two, three,"]
    batched = [m.content for m in llm.batch(prompts)]
    assert batched == [llm.invoke(p).content for p in prompts]


def test_completions_llm_batch_sends_several_prompts(tiny_server):
    llm = OpenAI(model=MODEL_NAME, base_url=f"{tiny_server.base_url}/v1", api_key="unused", temperature=0,
                 max_tokens=4, max_retries=0, batch_size=8)
    prompts = [words(10, 11), words(12), words(13, 14, 15)]
    result = llm.generate(prompts)  # one /v1/completions request with three prompts
    texts = [g[0].text for g in result.generations]
    client = tiny_server.client()
    assert texts == [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=4, temperature=0).choices[0].text
                     for p in prompts]
    assert llm.batch(prompts) == texts
