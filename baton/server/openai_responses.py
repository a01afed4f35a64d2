"""OpenAI's Responses API (`POST /v1/responses`) on the chat endpoint's work: the request becomes a
chat conversation (instructions, text or message input, function calls and their outputs, the
conversation of `previous_response_id`), the chat answer becomes output items (a message, function
calls, reasoning), and a stream becomes the Responses event sequence. Responses are kept for
`previous_response_id` (unless `store` is false) in memory, bounded in count and bytes, dropped
oldest first."""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from baton.http import APIError
from baton.server.protocol import ChatCompletionRequest
from baton.server.responses import sse, usage

MAX_ITEMS = 256
MAX_TEXT = 1 << 20  # characters of one input text


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Loose):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: str = Field(max_length=MAX_TEXT)


class InputItem(_Loose):
    """A message ({role, content}), a function call the model made, or a function call's output."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: Annotated[str, Field(max_length=MAX_TEXT)] | list[ContentPart] | None = None
    call_id: str | None = Field(None, max_length=128)
    name: str | None = Field(None, max_length=256)
    arguments: str | None = Field(None, max_length=MAX_TEXT)
    output: str | None = Field(None, max_length=MAX_TEXT)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionTool(_Loose):
    type: Literal["function"]
    name: str = Field(max_length=256)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(_Loose):
    type: Literal["function"]
    name: str = Field(max_length=256)


class TextFormat(_Loose):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(_Loose):
    format: TextFormat | None = None


class ResponsesRequest(_Loose):
    model: str | None = None
    input: Annotated[str, Field(max_length=MAX_TEXT)] | list[InputItem] = Field(max_length=MAX_ITEMS)
    instructions: str | None = Field(None, max_length=MAX_TEXT)
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, max_length=128)
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)


class ResponseStore:
    """Stored responses by id: the conversation they end (chat messages), least recently stored out."""

    def __init__(self, max_count: int = 1024, max_bytes: int = 64 << 20) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: OrderedDict[str, tuple[list[dict], int]] = OrderedDict()
        self._bytes = 0

    def put(self, response_id: str, messages: list[dict]) -> None:
        size = len(json.dumps(messages))
        if size > self.max_bytes:
            return
        self._items[response_id] = (messages, size)
        self._bytes += size
        while len(self._items) > self.max_count or self._bytes > self.max_bytes:
            _, (_, gone) = self._items.popitem(last=False)
            self._bytes -= gone

    def get(self, response_id: str) -> list[dict]:
        if response_id not in self._items:
            raise APIError(404, f"no stored response {response_id[:128]!r} (never stored, or dropped)")
        return self._items[response_id][0]


def chat_messages(body: ResponsesRequest, history: list[dict]) -> list[dict]:
    """The conversation as chat messages: the stored one first, then instructions, then the input."""
    messages = list(history)
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *[m for m in messages if m["role"] != "system"]]
    items = [InputItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in items:
        if item.type == "message":
            role = "system" if item.role == "developer" else item.role or "user"
            messages.append({"role": role, "content": item.text()})
        elif item.type == "function_call":
            call = {"id": item.call_id or _id("call"), "type": "function"}
            call["function"] = {"name": item.name or "", "arguments": item.arguments or "{}"}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id or "", "content": item.output or ""})
    if not any(m["role"] != "system" for m in messages):
        raise APIError(400, "input is empty")
    return messages


def chat_request(body: ResponsesRequest, messages: list[dict], stream: bool) -> ChatCompletionRequest:
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "stream": stream}
    if stream:
        fields["stream_options"] = {"include_usage": True}
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": t.model_dump(include={"name", "description", "parameters"})}
            for t in body.tools
        ]
        choice = body.tool_choice
        fields["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}} if isinstance(choice, NamedFunction) else choice
        )
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
    for name in ("temperature", "top_p"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    if body.max_output_tokens is not None:
        fields["max_tokens"] = body.max_output_tokens
    return ChatCompletionRequest.model_validate(fields)


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def output_items(message: dict) -> list[dict]:
    """A chat answer's message as Responses output items."""
    items = []
    if message.get("reasoning_content"):
        thought = {"type": "summary_text", "text": message["reasoning_content"]}
        items.append({"type": "reasoning", "id": _id("rs"), "summary": [thought]})
    if message.get("content") or (message.get("content") is not None and not message.get("tool_calls")):
        part = {
            "type": "output_text",
            "text": message["content"],
            "annotations": [],
        }  # a call's reply may say something first
        items.append(
            {"type": "message", "id": _id("msg"), "status": "completed", "role": "assistant", "content": [part]}
        )
    for call in message.get("tool_calls") or []:
        items.append(
            {
                "type": "function_call",
                "id": _id("fc"),
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    return items


def response_object(
    body: ResponsesRequest, rid: str, served: str, output: list[dict], finish: str | None, counts: dict | None
) -> dict:
    incomplete = finish == "length"
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed" if counts is not None else "in_progress",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": served,
        "output": output,
        "instructions": body.instructions,
        "tools": [t.model_dump(by_alias=True) for t in body.tools or []],
        "tool_choice": (
            body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction) else body.tool_choice
        )
        or "auto",
        "parallel_tool_calls": bool(body.parallel_tool_calls),
        "text": {
            "format": (
                body.text.format.model_dump(by_alias=True) if body.text and body.text.format else {"type": "text"}
            )
        },
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "metadata": body.metadata or {},
        "usage": None
        if counts is None
        else {
            "input_tokens": counts["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": counts["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": counts["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts["total_tokens"],
        },
    }


async def stream_events(
    body: ResponsesRequest, rid: str, served: str, chunks: AsyncIterator[dict], done
) -> AsyncIterator[dict]:
    """The Responses event sequence of a chat stream's chunks; `done(message)` when it ends."""
    seq = 0

    def event(kind: str, **fields) -> dict:
        nonlocal seq
        seq += 1
        return {"type": kind, "sequence_number": seq - 1, **fields}

    yield event("response.created", response=response_object(body, rid, served, [], None, None))
    yield event("response.in_progress", response=response_object(body, rid, served, [], None, None))
    text, thought, finish, counts = "", "", None, None
    calls: dict[int, dict] = {}
    msg_id, opened, at, ids = _id("msg"), False, 0, {}
    async for chunk in chunks:
        counts = chunk.get("usage") or counts
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            thought += delta.get("reasoning_content") or ""
            for d in delta.get("tool_calls") or []:  # an id and name, then the arguments, by index
                call = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
                call["id"] = d.get("id") or call["id"]
                call["name"] += (d.get("function") or {}).get("name") or ""
                call["arguments"] += (d.get("function") or {}).get("arguments") or ""
            finish = choice.get("finish_reason") or finish
            piece = delta.get("content") or ""
            if piece:
                if not opened:  # after a reasoning item, if the model thought first
                    opened, at = True, 1 if thought else 0
                    item = {"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant"}
                    yield event("response.output_item.added", output_index=at, item={**item, "content": []})
                    part = {"type": "output_text", "text": "", "annotations": []}
                    ids = {"item_id": msg_id, "output_index": at, "content_index": 0}
                    yield event("response.content_part.added", **ids, part=part)
                text += piece
                yield event("response.output_text.delta", **ids, delta=piece, logprobs=[])
    message = {"content": text, "reasoning_content": thought or None}
    message["tool_calls"] = [
        {"id": c["id"] or _id("call"), "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for _, c in sorted(calls.items())
    ] or None
    output = output_items(message)
    for i, item in enumerate(output):
        if item["type"] == "message" and opened:  # streamed already: closed here
            item["id"] = msg_id
            part = item["content"][0]
            ids = {"item_id": msg_id, "output_index": i, "content_index": 0}
            yield event("response.output_text.done", **ids, text=text, logprobs=[])
            yield event("response.content_part.done", **ids, part=part)
            yield event("response.output_item.done", output_index=i, item=item)
            continue
        added = {**item, "status": "in_progress"} | ({"arguments": ""} if item["type"] == "function_call" else {})
        yield event("response.output_item.added", output_index=i, item=added)
        if item["type"] == "function_call":
            args = item["arguments"]
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=i, delta=args)
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=i, arguments=args)
        yield event("response.output_item.done", output_index=i, item=item)
    final = response_object(body, rid, served, output, finish, counts or usage(0, 0))
    done(message, final)
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield event(kind, response=final)


async def create_response(serving, store: ResponseStore, body: ResponsesRequest, rid: str, served: str):
    """A response (or its event stream) through the chat endpoint's work."""
    history = store.get(body.previous_response_id) if body.previous_response_id else []
    messages = chat_messages(body, history)
    chat = chat_request(body, messages, body.stream)

    def done(message: dict, final: dict) -> None:
        if body.store:
            reply = {"role": "assistant", "content": message.get("content")}
            if message.get("tool_calls"):
                reply["tool_calls"] = message["tool_calls"]
            store.put(rid, [*messages, reply])

    if body.stream:
        return sse(stream_events(body, rid, served, await serving.chat(chat, rid, raw_stream=True), done))
    result = await serving.chat(chat, rid)
    choice = result["choices"][0]
    final = response_object(
        body, rid, served, output_items(choice["message"]), choice["finish_reason"], result["usage"]
    )
    done(choice["message"], final)
    return final
