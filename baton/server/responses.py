"""Engine outputs to OpenAI response bodies: whole responses, stream chunks (server-sent events),
logprobs in both shapes."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse

from baton.outputs import PositionLogprobs, RequestOutput


@dataclass
class ChoiceStream:
    """What one streamed choice has sent so far."""

    text_sent: int = 0
    reasoning_sent: int = 0
    tokens_sent: int = 0
    finished: bool = False


@dataclass
class Timing:
    start: float = field(default_factory=time.perf_counter)
    first_token: float | None = None

    def saw(self, out: RequestOutput) -> None:
        if self.first_token is None and any(c.token_ids for c in out.outputs):
            self.first_token = time.perf_counter()


def stream_safe_text(text: str, finished: bool, stop: list[str]) -> str:
    """The part of the text that can be sent now: hold back a possible stop-string prefix and a
    trailing incomplete UTF-8 character, which a later token may still change."""
    if finished:
        return text
    if stop:
        text = text[: max(0, len(text) - (max(len(s) for s in stop) - 1))]
    return text.rstrip("\ufffd")


class TokenText:
    """Token id -> its text piece, for logprobs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"<{token_id}>"


def completion_logprobs(
    token_ids: list[int], entries: list[PositionLogprobs | None], piece: TokenText, text_offset: int = 0
) -> dict:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for tid, entry in zip(token_ids, entries):
        text = piece(tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(entry[tid].logprob)
        tops.append({piece(t): lp.logprob for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], entries: list[PositionLogprobs], piece: TokenText, top_n: int) -> dict:
    content = []
    for tid, entry in zip(token_ids, entries):
        text = piece(tid)
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:top_n]
        content.append(
            {
                "token": text,
                "logprob": entry[tid].logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": piece(t), "logprob": lp.logprob, "bytes": list(piece(t).encode())} for t, lp in ranked
                ],
            }
        )
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens served from the
    prefix cache (as OpenAI and vLLM report them)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


async def _events(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
    except Exception as e:  # headers are gone: report in-band, as OpenAI servers do
        err = {"error": {"message": str(e), "type": "server_error", "param": None, "code": 500}}
        yield f"data: {json.dumps(err)}\n\n"
    yield "data: [DONE]\n\n"


def sse(events: AsyncIterator[dict]) -> StreamingResponse:
    return StreamingResponse(_events(events), media_type="text/event-stream")
