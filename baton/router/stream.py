"""Server-sent events as the router relays them: whole events, the usage a worker reports, and the
preamble a chat stream opens with (held back until content arrives, so a stream that fails before
its first token can still move to another worker)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp

from baton.http import UpstreamTooLarge

_PREAMBLE_DELTA = {"role": "assistant", "content": ""}


async def sse_events(
    upstream: aiohttp.ClientResponse, max_event_bytes: int, first_s: float, idle_s: float
) -> AsyncIterator[bytes]:
    """The body's events, each whole with its blank-line terminator, as soon as each is complete.
    Until an event other than a chat preamble arrived, each read may take `first_s` (the prefill);
    after it, `idle_s`. An event larger than `max_event_bytes` is UpstreamTooLarge."""
    buf = b""
    started = False
    while chunk := await asyncio.wait_for(upstream.content.readany(), idle_s if started else first_s):
        buf += chunk
        *events, buf = buf.split(b"\n\n")
        for event in events:
            started = started or not is_preamble(event)
            yield event + b"\n\n"
        if len(buf) > max_event_bytes:
            raise UpstreamTooLarge(f"a stream event of more than {max_event_bytes} bytes")
    if buf:
        yield buf


def _data(event: bytes) -> dict | None:
    if not event.startswith(b"data: {"):
        return None
    try:
        data = json.loads(event[6:])
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def is_preamble(event: bytes) -> bool:
    """A chat stream's opening chunk: the assistant role, no content yet."""
    if b'"role"' not in event:
        return False
    data = _data(event)
    choices = data.get("choices") if data else None
    return bool(choices) and all(
        isinstance(c, dict) and c.get("delta") == _PREAMBLE_DELTA and c.get("finish_reason") is None for c in choices
    )


def usage_chunk(event: bytes) -> dict | None:
    """The usage of a stream's usage-only chunk (no choices), else None."""
    if b'"usage"' not in event:
        return None
    data = _data(event)
    if data is None or data.get("choices") or not isinstance(data.get("usage"), dict):
        return None
    return data["usage"]


def usage_of_body(data: bytes) -> dict | None:
    """The usage object of a non-streamed answer."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return None
    usage = body.get("usage") if isinstance(body, dict) else None
    return usage if isinstance(usage, dict) else None


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def cached_and_prompt_tokens(usage: dict) -> tuple[int, int]:
    """(prompt tokens served from the worker's prefix cache, prompt tokens)."""
    details = usage.get("prompt_tokens_details")
    return _count(details.get("cached_tokens") if isinstance(details, dict) else 0), _count(usage.get("prompt_tokens"))


def error_event(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": 502}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
