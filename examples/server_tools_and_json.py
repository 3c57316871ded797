#!/usr/bin/env python
"""Tool calls, JSON-schema output and logprobs from a running ``kvboost-hf serve``, with the openai SDK.

    kvboost-hf serve &                                   # embedded Gemma-3-270M on 127.0.0.1:8000
    python examples/server_tools_and_json.py
    python examples/server_tools_and_json.py --base-url http://127.0.0.1:8000/v1 --model gemma-3-270m

The embedded model is a base model: it does not follow instructions, but what it returns under
``response_format`` or a forced ``tool_choice`` is still valid JSON for the schema (grammar-
constrained decoding), which is what this script checks.
"""

from __future__ import annotations

import argparse
import json

from openai import OpenAI

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                       "required": ["city"]},
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--api-key", default="unused")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)

    person = client.chat.completions.create(
        model=args.model, messages=[{"role": "user", "content": "Describe a person."}], temperature=0, max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    print("json_schema:", json.loads(person.choices[0].message.content))

    call = client.chat.completions.create(
        model=args.model, messages=[{"role": "user", "content": "What is the weather in Lisbon?"}], temperature=0,
        max_tokens=32, tools=[WEATHER], tool_choice="required",
    ).choices[0].message.tool_calls[0]
    print("tool call:", call.function.name, json.loads(call.function.arguments))

    scored = client.completions.create(model=args.model, prompt="The capital of France is Paris",
                                       max_tokens=0, echo=True, logprobs=0)
    lp = scored.choices[0].logprobs
    print("prompt logprobs:", [(t, None if v is None else round(v, 3)) for t, v in zip(lp.tokens, lp.token_logprobs)])


if __name__ == "__main__":
    main()
