"""Tool calls in a model's own format, where its chat template renders tools (vLLM's
`--tool-call-parser` names). The template renders the tools and the history (assistant calls,
`tool` results) itself; the reply is parsed back from the model's syntax; a forced or `required`
call is held to that syntax by a grammar over the tools' (strict) schemas.

hermes (Hermes 2 Pro, Qwen2.5, Qwen3): each call is `<tool_call>\\n{"name": ..., "arguments": {...}}
\\n</tool_call>`, several in a row for parallel calls; text outside the tags is the content.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from baton.sampling_params import StructuredOutputsParams
from baton.server.tools import MAX_PARALLEL_CALLS, strict_schema

TOOL_CALL_PARSERS = ("hermes",)
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass(frozen=True)
class HermesFormat:
    name: str = "hermes"
    open_tag: str = "<tool_call>"

    @staticmethod
    def detect(template: str | None) -> bool:
        return bool(template) and "<tool_call>" in template

    def grammar(self, tools: list[dict], parallel: bool) -> StructuredOutputsParams:
        """Only calls (of `tools`), in this format: what `required` and a named function allow."""
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
        schema = json.dumps({"anyOf": calls})
        more = f'("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        lark = f'start: call {more}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {schema}\n'
        return StructuredOutputsParams(grammar=lark)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a reply; a call that is not JSON stays in the content."""
        calls, kept = [], []
        last = 0
        for m in _HERMES.finditer(text):
            try:
                call = json.loads(m.group(1))
            except json.JSONDecodeError:
                continue
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                continue
            kept.append(text[last : m.start()])
            last = m.end()
            arguments = call.get("arguments", call.get("parameters", {}))
            calls.append(
                {
                    "id": f"call_{secrets.token_hex(12)}",
                    "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
                }
            )
        kept.append(text[last:])
        content = "".join(kept)
        if calls:
            cut = content.find(self.open_tag)  # a call max_tokens cut after the whole ones
            content = content[:cut] if cut >= 0 else content
            return (content.strip() or None), calls
        cut = text.find(self.open_tag)
        if cut >= 0:  # only a cut call: none of the syntax in the content
            return (text[:cut].strip() or None), []
        return text, []


FORMATS = {"hermes": HermesFormat()}


def template_format(name: str | None, template: str | None) -> HermesFormat | None:
    """The format `--tool-call-parser` names ("generic": none), else the one the template shows."""
    if name == "generic":
        return None
    if name is not None:
        return FORMATS[name]
    return next((f for f in FORMATS.values() if f.detect(template)), None)
