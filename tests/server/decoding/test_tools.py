"""Tool-call parsing, the call grammar's schema, and prompts for templates without tool support."""

from __future__ import annotations

import json

import jsonschema

from kvboost_hf.server.decoding.tools import call_schema, parse_tool_calls, plain_turns, with_tools_system

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
]


def test_parse_hermes_blocks_and_whole_json():
    text = 'sure <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>' \
           '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
    calls = parse_tool_calls(text, TOOLS)
    assert [c.name for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[0].arguments) == {"a": 1, "b": 2} and json.loads(calls[1].arguments) == {"city": "Oslo"}
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    whole = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Rome"}}', TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in whole] == [("get_weather", {"city": "Rome"})]


def test_parse_rejects_unknown_names_and_non_calls():
    assert parse_tool_calls('{"name": "rm_rf", "arguments": {}}', TOOLS) == []
    assert parse_tool_calls("the weather is fine", TOOLS) == []
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', TOOLS) == []
    assert parse_tool_calls('<tool_call>{not json</tool_call>', TOOLS) == []


def test_call_schema_accepts_exactly_calls_to_the_chosen_tool():
    named = call_schema(TOOLS, "add")
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, named)
    for bad in ({"name": "get_weather", "arguments": {"city": "x"}}, {"name": "add", "arguments": {"a": 1}},
                {"name": "add", "arguments": {"a": 1, "b": 2}, "extra": 1}):
        try:
            jsonschema.validate(bad, named)
        except jsonschema.ValidationError:
            continue
        raise AssertionError(f"{bad} validated")
    anyone = call_schema(TOOLS, None)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "x"}}, anyone)
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, anyone)


def test_plain_turns_for_templates_without_tool_roles():
    messages = [
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
        {"role": "tool", "content": "again 3", "tool_call_id": "c2"},
    ]
    turns = plain_turns(messages)
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]  # two results in a row become one turn
    assert '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>' in turns[1]["content"]
    assert turns[2]["content"] == "<tool_response>3</tool_response>\n<tool_response>again 3</tool_response>"
    system = with_tools_system([{"role": "system", "content": "be brief"}, *turns], TOOLS)
    assert system[0]["content"].startswith("be brief\n\n") and '"name": "get_weather"' in system[0]["content"]
    assert with_tools_system(turns, TOOLS)[0]["role"] == "system"
