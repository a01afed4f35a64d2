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


@dataclass
class ToolPlan:
    messages: list[dict]  # for the chat template
    structured: StructuredOutputsParams | None  # None: tool_choice none, or no tools


def plan_tools(messages: list[dict], tools: list[dict] | None, tool_choice) -> ToolPlan:
    """`messages` as chat template dicts (assistant tool calls and tool results included), `tools`
    OpenAI function tools, `tool_choice` "none" | "auto" | "required" | {"function": {"name": ...}}."""
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
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
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
    system = INSTRUCTIONS.format(tools=described, or_response=or_response)
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
        call = m["tool_calls"][0]["function"]
        arguments = call.get("arguments") or "{}"
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass  # shown as the string it was
        content = json.dumps({"tool_call": {"name": call["name"], "arguments": arguments}}, ensure_ascii=False)
        return {"role": "assistant", "content": content}
    if m["role"] == "tool":
        return {"role": "user", "content": f"Result of tool call {m.get('tool_call_id') or ''}: {m['content']}"}
    return {"role": m["role"], "content": m["content"]}


def parse_reply(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a reply written under plan_tools's grammar; text that is not such a
    reply (cut by max_tokens) is returned as content."""
    try:
        reply = json.loads(text)
    except json.JSONDecodeError:
        return text, []
    if isinstance(reply, dict) and isinstance(reply.get("tool_call"), dict):
        call = reply["tool_call"]
        arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
        tool_call = {
            "id": f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {"name": call.get("name"), "arguments": arguments},
        }
        return None, [tool_call]
    if isinstance(reply, dict) and isinstance(reply.get("response"), str):
        return reply["response"], []
    return text, []
