"""Tool calling: prompts through the tokenizer's chat template (``tools=``), a grammar for forced
calls, and parsing generated text into OpenAI ``tool_calls``.

Templates that render tools (Qwen2.5, Llama 3.1, Hermes, Mistral, ...) get them through
``apply_chat_template(..., tools=...)``. A template that ignores ``tools`` (the embedded Gemma
base model's turn format) gets the tool list and the call format as a system text instead, and
``tool`` / assistant ``tool_calls`` messages are written as plain turns it can render.

A call is recognised in the reply as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks (Hermes / Qwen format) or as a reply that is a whole JSON object (or list of objects) with
``name`` and ``arguments`` (or ``parameters``) naming a requested tool. With ``tool_choice``
``"required"`` or a named function the reply is generated under a grammar for exactly that object.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_FREE_PARAMETERS: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function name and its arguments as a JSON string (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = ""

    def openai(self, index: int | None = None) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        out: dict[str, Any] = {"id": self.id, "type": "function", "function": function}
        return out if index is None else {"index": index, **out}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or _FREE_PARAMETERS


def call_schema(tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    """JSON schema of one call object: to the function ``name``, or to any of ``tools`` when None."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    options = [
        {"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "arguments": tool_parameters(t)},
         "required": ["name", "arguments"], "additionalProperties": False}
        for t in chosen
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template mentions ``tools`` (so ``tools=`` reaches the prompt)."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """The tool list and call format, for templates that do not render tools themselves."""
    listed = "\n".join(json.dumps(t["function"], sort_keys=True) for t in tools)
    return (
        "You can call these functions:\n" + listed + "\n"
        'To call one, answer only <tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>.'
    )


def plain_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``tool`` results as user turns and assistant ``tool_calls`` as text, for templates without tool roles."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>{message.get('content') or ''}</tool_response>"})
        elif message["role"] == "assistant" and message.get("tool_calls"):
            calls = "".join(
                f"<tool_call>{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}</tool_call>"
                for c in message["tool_calls"]
            )
            out.append({"role": "assistant", "content": (message.get("content") or "") + calls})
        else:
            out.append({k: v for k, v in message.items() if k in ("role", "content")})
    return _merge_same_roles(out)


def _merge_same_roles(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Join consecutive turns of one role (several tool results in a row), which strict templates refuse."""
    merged: list[dict[str, Any]] = []
    for message in messages:
        if merged and merged[-1]["role"] == message["role"] and message["role"] != "system":
            merged[-1] = {**merged[-1], "content": merged[-1]["content"] + "\n" + message["content"]}
        else:
            merged.append(dict(message))
    return merged


def with_tools_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Put :func:`tools_system_text` into the system message (creating one when there is none)."""
    text = tools_system_text(tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def parse_tool_calls(text: str, tools: list[dict[str, Any]]) -> list[ToolCall]:
    """The calls to requested tools in ``text`` (empty when it holds none)."""
    names = {t["function"]["name"] for t in tools}
    blocks = _TOOL_CALL_BLOCK.findall(text)
    candidates: list[Any] = []
    for raw in blocks or [text.strip()]:
        try:
            value = json.loads(raw)
        except ValueError:
            continue
        candidates.extend(value if isinstance(value, list) else [value])
    calls = []
    for value in candidates:
        if not isinstance(value, dict) or value.get("name") not in names:
            continue
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                continue
        if not isinstance(arguments, dict):
            continue
        calls.append(ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False), new_call_id()))
    return calls
