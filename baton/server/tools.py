"""Tool calls for chat models whatever their template (llama.cpp's "generic" format): the tools are
described in a system message, the reply is one JSON object, either {"tool_call": {"name": ...,
"arguments": {...}}} or {"response": "..."}, and a grammar built from the tools' JSON schemas holds
the model to it. `required` and a named function allow only tool calls (of that function); `auto`
allows a response too; `none` leaves tools out. Earlier turns are rendered in the same format, so
the conversation reads as the model was asked to write."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from baton.sampling_params import StructuredOutputsParams

INSTRUCTIONS = (
    "You can call these tools:\n{tools}\n\n"
    'Reply with one JSON object: {{"tool_call": {{"name": <tool name>, "arguments": <its arguments>}}}} '
    "to call a tool{or_response}."
)


PARALLEL_INSTRUCTIONS = (
    "You can call these tools:\n{tools}\n\n"
    'Reply with one JSON object: {{"tool_calls": [{{"name": <tool name>, "arguments": <its arguments>}}, ...]}} '
    "to call one or more tools{or_response}."
)
MAX_PARALLEL_CALLS = 16
MAX_SCHEMA_DEPTH = 64


def strict_schema(schema, depth: int = 0):
    """A copy of a tool's parameter schema held as OpenAI's `strict` mode holds it: an object schema
    that does not say `additionalProperties` takes no property it does not name (small models
    otherwise fill arguments with the schema's own keywords, or repeat a key to max_tokens)."""
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"a tool's parameter schema nests deeper than {MAX_SCHEMA_DEPTH}")
    if isinstance(schema, list):
        return [strict_schema(x, depth + 1) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v, depth + 1) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: strict_schema(sub, depth + 1) for name, sub in schema[key].items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = {"items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "if", "then", "else", "additionalProperties"}


@dataclass
class ToolPlan:
    messages: list[dict]  # for the chat template
    structured: StructuredOutputsParams | None  # None: tool_choice none, or no tools


def plan_tools(messages: list[dict], tools: list[dict] | None, tool_choice, parallel: bool = False) -> ToolPlan:
    """`messages` as chat template dicts (assistant tool calls and tool results included), `tools`
    OpenAI function tools, `tool_choice` "none" | "auto" | "required" | {"function": {"name": ...}};
    `parallel` (parallel_tool_calls): the reply may call several, {"tool_calls": [...]}, as
    llama.cpp's generic format does."""
    rendered = [_render(m) for m in messages]
    if not tools or tool_choice == "none":
        return ToolPlan(rendered, None)
    names = [t["function"]["name"] for t in tools]
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in names:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools: {names}")
        tools = [t for t in tools if t["function"]["name"] == name]
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": strict_schema(t["function"].get("parameters") or {"type": "object"}),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    if parallel:
        many = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}
        call = {"type": "object", "properties": {"tool_calls": many}, "required": ["tool_calls"]}
    else:
        call = {"type": "object", "properties": {"tool_call": {"anyOf": calls}}, "required": ["tool_call"]}
    call["additionalProperties"] = False
    choices = [call]
    if tool_choice in (None, "auto"):
        choices.append(
            {
                "type": "object",
                "properties": {"response": {"type": "string"}},
                "required": ["response"],
                "additionalProperties": False,
            }
        )
    described = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    or_response = ', or {"response": <your answer>} to answer the user' if len(choices) > 1 else ""
    system = (PARALLEL_INSTRUCTIONS if parallel else INSTRUCTIONS).format(tools=described, or_response=or_response)
    if rendered and rendered[0]["role"] == "system":
        rendered[0] = {"role": "system", "content": rendered[0]["content"] + "\n\n" + system}
    else:
        rendered.insert(0, {"role": "system", "content": system})
    schema = choices[0] if len(choices) == 1 else {"anyOf": choices}
    return ToolPlan(rendered, StructuredOutputsParams(json=schema))


def _render(m: dict) -> dict:
    """Assistant tool calls as the JSON the model writes; tool results as a user turn (templates
    without tools know no "tool" role)."""
    if m["role"] == "assistant" and m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            arguments = c["function"].get("arguments") or "{}"
            try:
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError:
                pass  # shown as the string it was
            calls.append({"name": c["function"]["name"], "arguments": arguments})
        reply = {"tool_call": calls[0]} if len(calls) == 1 else {"tool_calls": calls}
        return {"role": "assistant", "content": json.dumps(reply, ensure_ascii=False)}
    if m["role"] == "tool":
        return {"role": "user", "content": f"Result of tool call {m.get('tool_call_id') or ''}: {m['content']}"}
    return {"role": m["role"], "content": m["content"]}


def parse_reply(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a reply written under plan_tools's grammar. A reply cut by
    max_tokens shows none of the format: a cut response gives what it had said, a cut call nothing."""
    try:
        reply = json.loads(text)
    except json.JSONDecodeError:
        return _cut_response(text), []
    if not isinstance(reply, dict):
        return text, []
    calls = reply.get("tool_calls") if isinstance(reply.get("tool_calls"), list) else [reply.get("tool_call")]
    calls = [c for c in calls if isinstance(c, dict)]
    if calls:
        return None, [
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {
                    "name": c.get("name"),
                    "arguments": json.dumps(c.get("arguments", {}), ensure_ascii=False),
                },
            }
            for c in calls
        ]
    if isinstance(reply.get("response"), str):
        return reply["response"], []
    return text, []


def _cut_response(text: str) -> str | None:
    """The text of a `{"response": "...` reply that max_tokens cut; None for anything else (a cut call)."""
    head = '{"response": "'
    if not text.startswith(head):
        return None
    body = text[len(head) :]
    for end in range(len(body), max(-1, len(body) - 8), -1):  # drop a cut escape sequence
        try:
            return json.loads('"' + body[:end] + '"')
        except json.JSONDecodeError:
            continue
    return None
