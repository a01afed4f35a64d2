"""Tool calls in a model's own format, where its chat template renders tools (vLLM's
`--tool-call-parser` names). The template renders the tools and the history (assistant calls,
`tool` results) itself; the reply is parsed back from the model's syntax; a forced or `required`
call is held to that syntax by a grammar over the tools' (strict) schemas.

hermes (Hermes 2 Pro, Qwen2.5, Qwen3): each call is `<tool_call>\\n{"name": ..., "arguments": {...}}
\\n</tool_call>`, several in a row for parallel calls; text outside the tags is the content.
llama3_json (Llama 3.1-3.3's JSON tool calling): the reply is `{"name": ..., "parameters": {...}}`
(after an optional `<|python_tag|>`), several separated by `; `.
mistral: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`.
glm45 (GLM-4.5, 4.6): `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n...
</tool_call>`, a string value as itself, any other as JSON; several calls in a row.

Every format's `parse(text, tools)` gives (content, tool calls); a call max_tokens cut shows none
of the syntax in the content.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from baton.sampling_params import StructuredOutputsParams
from baton.server.tools import MAX_PARALLEL_CALLS, strict_schema

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
        calls = _call_schemas(tools, "arguments")
        schema = json.dumps({"anyOf": calls})
        more = f'("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        lark = f'start: call {more}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {schema}\n'
        return StructuredOutputsParams(grammar=lark)

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str | None, list[dict]]:
        """A call that is not JSON stays in the content."""
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
            calls.append(_tool_call(call["name"], call.get("arguments", call.get("parameters", {}))))
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


def _call_schemas(tools: list[dict], key: str) -> list[dict]:
    return [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                key: strict_schema(t["function"].get("parameters") or {"type": "object"}),
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
    ]


def _tool_call(name: str, arguments) -> dict:
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _as_calls(items) -> list[dict] | None:
    """Tool calls of decoded JSON objects, or None if one is not a call."""
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        calls.append(_tool_call(item["name"], item.get("arguments", item.get("parameters", {}))))
    return calls


@dataclass(frozen=True)
class Llama3JsonFormat:
    name: str = "llama3_json"

    @staticmethod
    def detect(template: str | None) -> bool:
        return bool(template) and "dictionary of argument name and its value" in template

    def grammar(self, tools: list[dict], parallel: bool) -> StructuredOutputsParams:
        schema = json.dumps({"anyOf": _call_schemas(tools, "parameters")})
        more = f'("; " call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        return StructuredOutputsParams(grammar=f"start: call {more}\ncall: %json {schema}\n")

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str | None, list[dict]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        decoder, items, i = json.JSONDecoder(), [], 0
        try:
            while i < len(body):
                item, i = decoder.raw_decode(body, i)
                items.append(item)
                while i < len(body) and body[i] in "; \n":
                    i += 1
        except json.JSONDecodeError:
            return (None if body.startswith('{"name"') else text), []  # a cut call shows nothing
        calls = _as_calls(items)
        return (None, calls) if calls else (text, [])


@dataclass(frozen=True)
class MistralFormat:
    name: str = "mistral"
    tag: str = "[TOOL_CALLS]"

    def detect(self, template: str | None) -> bool:
        return bool(template) and self.tag in template

    def grammar(self, tools: list[dict], parallel: bool) -> StructuredOutputsParams:
        calls = {"anyOf": _call_schemas(tools, "arguments")}
        array = {"type": "array", "items": calls, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1}
        return StructuredOutputsParams(grammar=f'start: "{self.tag}" calls\ncalls: %json {json.dumps(array)}\n')

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str | None, list[dict]]:
        at = text.find(self.tag)
        if at < 0:
            return text, []
        content = text[:at].strip() or None
        try:
            items = json.loads(text[at + len(self.tag) :])
        except json.JSONDecodeError:
            return content, []  # a cut call shows nothing
        calls = _as_calls(items if isinstance(items, list) else [items])
        return (content, calls) if calls else (text, [])


NL = "\n"
_GLM_CALL = re.compile(r"<tool_call>([^<\n]*)(.*?)</tool_call>", re.S)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


@dataclass(frozen=True)
class Glm45Format:
    name: str = "glm45"
    open_tag: str = "<tool_call>"

    @staticmethod
    def detect(template: str | None) -> bool:
        return bool(template) and "<arg_key>" in template

    def grammar(self, tools: list[dict], parallel: bool) -> StructuredOutputsParams:
        """Each tool's call with its (strict) schema's properties in the schema's order, the
        required ones present, the others optional, each at most once."""
        rules, calls = [], []
        for i, tool in enumerate(tools):
            schema = strict_schema(tool["function"].get("parameters") or {"type": "object"})
            props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
            required = schema.get("required") if isinstance(schema.get("required"), list) else []
            defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # what a value's $ref names
            args = []
            for j, (key, sub) in enumerate(props.items()):
                value = f"v{i}_{j}"
                rules.append(f"{value}: {_glm_value(sub, defs)}")
                arg = f"{_lit(f'<arg_key>{key}</arg_key>' + NL + '<arg_value>')} {value} {_lit('</arg_value>' + NL)}"
                args.append(arg if key in required else f"({arg})?")
            calls.append(f"call{i}")
            head = _lit(f"<tool_call>{tool['function']['name']}" + NL)
            rules.append(f"call{i}: {head} {' '.join(args)} {_lit('</tool_call>')}")
        more = f'("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        lark = f"start: call {more}\ncall: {' | '.join(calls)}\n" + "\n".join(rules) + "\n"
        return StructuredOutputsParams(grammar=lark)

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str | None, list[dict]]:
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or []}
        calls, kept, last = [], [], 0
        for m in _GLM_CALL.finditer(text):
            name = m.group(1).strip()
            if not name:
                continue
            props = schemas.get(name, {}).get("properties")
            props = props if isinstance(props, dict) else {}
            args = {k.strip(): _glm_decode(v, props.get(k.strip())) for k, v in _GLM_ARG.findall(m.group(2))}
            kept.append(text[last : m.start()])
            last = m.end()
            calls.append(_tool_call(name, args))
        kept.append(text[last:])
        content = "".join(kept)
        cut = content.find(self.open_tag)  # a call max_tokens cut
        if cut >= 0:
            content = content[:cut]
        if calls or cut >= 0:
            return (content.strip() or None), calls
        return text, []


def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _is_string(schema) -> bool:
    return isinstance(schema, dict) and (
        schema.get("type") == "string" or (schema.get("enum") and all(isinstance(e, str) for e in schema["enum"]))
    )


def _glm_value(schema, defs: dict) -> str:
    """A value's grammar: a string as itself (its enum's members, or text without a `<`), any
    other value as JSON under its schema."""
    if _is_string(schema):
        if schema.get("enum"):
            return " | ".join(_lit(e) for e in schema["enum"])
        return "/[^<]*/"
    return f"%json {json.dumps({**schema, **defs} if isinstance(schema, dict) else {})}"


def _glm_decode(value: str, schema) -> object:
    """An argument's value: a string where the schema says string, else JSON (text if it is not)."""
    if _is_string(schema):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


FORMATS = {
    "glm45": Glm45Format(),  # before hermes: its template shows `<tool_call>` too
    "hermes": HermesFormat(),
    "mistral": MistralFormat(),
    "llama3_json": Llama3JsonFormat(),
}


def template_format(name: str | None, template: str | None):
    """The format `--tool-call-parser` names ("generic": none), else the one the template shows."""
    if name == "generic":
        return None
    if name is not None:
        return FORMATS[name]
    return next((f for f in FORMATS.values() if f.detect(template)), None)
