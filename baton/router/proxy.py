"""The router's request path: choose a worker by the policy, send the request there, and move it to
another worker when the first fails (cannot be reached, drops the connection, or is marked down by
a health check) before any byte of the answer reached the client. A worker's reported
`cached_tokens` are counted against the prefix the router expected it to hold."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from baton.handoff.remote_prefill import RemotePrefill
from baton.http import error_response, read_bounded
from baton.router.policy import make_policy
from baton.router.prefix_index import chunk_hashes, request_text
from baton.router.settings import RouterSettings
from baton.router.stream import (
    cached_and_prompt_tokens,
    error_event,
    is_preamble,
    sse_events,
    usage_chunk,
    usage_of_body,
)
from baton.router.workers import Lease, Worker, WorkerSet
from baton.server.protocol import ChatCompletionRequest, CompletionRequest

# what a worker that died or went away looks like from here
WORKER_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


class _WorkerFailed(Exception):
    """The worker was marked down while a request waited on it."""


@dataclass
class _Answer:
    status: int
    content_type: str | None
    data: bytes


@dataclass
class _OpenStream:
    upstream: aiohttp.ClientResponse
    events: AsyncIterator[bytes]
    held: list[bytes]  # read but not yet sent: the preamble and the first event with content


class _Relay(StreamingResponse):
    """A streamed answer that frees its worker however it ends, even if it never started."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _ask_for_usage(body: dict) -> bool:
    """Make a stream report its usage (the worker's cache hit); True when the client did not ask for
    it, so the router drops that chunk again. A malformed stream_options is left to the worker."""
    options = body.get("stream_options")
    if options is None:
        body["stream_options"] = {"include_usage": True}
        return True
    if isinstance(options, dict) and options.get("include_usage", False) is False:
        body["stream_options"] = {**options, "include_usage": True}
        return True
    return False


class Router:
    def __init__(self, workers: WorkerSet, settings: RouterSettings, prefill: RemotePrefill | None = None) -> None:
        self.workers = workers
        self.settings = settings
        self.policy = make_policy(settings.policy, settings.prefix_tokens_per_request, settings.min_prefix_share)
        self.prefill = prefill
        self.failovers = 0
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.settings.connect_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout)
        await self.workers.start(self.session)

    async def stop(self) -> None:
        await self.workers.stop()
        if self.session is not None:
            await self.session.close()

    def choose(self, text: str, hashes: list[int], exclude: set[str]) -> Worker | None:
        """The policy's pick for a request (its text and chunk hashes) among healthy workers not yet
        tried; the pick now holds the request's prefix."""
        candidates = [w for w in self.workers.up() if w.url not in exclude]
        if not candidates:
            return None
        prefix_tokens = [self.settings.chunks_to_tokens(w.index.match(hashes)) for w in candidates]
        i = self.policy.choose(candidates, prefix_tokens, len(text) / self.settings.chars_per_token)
        worker = candidates[i]
        worker.index.insert(hashes)
        worker.requests += 1
        worker.prefix_tokens_expected += prefix_tokens[i]
        return worker

    async def forward(self, endpoint: str, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            return error_response(400, f"malformed JSON: {type(e).__name__}")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object")
        body.pop("kv_transfer_id", None)  # a client never names a parked span: only this router does
        try:  # the workers' own model of the fields: "stream": "no" means here what it means there
            fields = (ChatCompletionRequest if endpoint == "chat" else CompletionRequest).model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        try:
            text = request_text(endpoint, body)
        except RecursionError:
            return error_response(400, "the body is nested too deeply")
        hashes = chunk_hashes(text, self.settings.chunk_chars, limit=self.settings.index_capacity_chunks)
        stream = fields.stream
        drop_usage = stream and _ask_for_usage(body)
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        tried: set[str] = set()
        busy: _Answer | None = None
        while (worker := self.choose(text, hashes, tried)) is not None:
            tried.add(worker.url)
            lease = Lease(worker)
            try:
                sent = self._send(worker, endpoint, path, raw, body, fields, headers)
                result = await self._unless_gone(worker, sent)
            except (_WorkerFailed, *WORKER_ERRORS) as e:
                lease.release()
                self.workers.mark_down(worker, f"a request failed: {type(e).__name__}: {e}"[:200])
                self.failovers += 1
                continue
            except BaseException:
                lease.release()
                raise
            if isinstance(result, _OpenStream):
                return self._relay(worker, lease, result, drop_usage)
            lease.release()
            if result.status == 503:  # full queue or a dead engine: another worker may take it
                busy = result
                continue
            if result.status == 200:
                self._count_usage(worker, usage_of_body(result.data))
            return Response(result.data, status_code=result.status, media_type=result.content_type)
        if busy is not None:
            return Response(busy.data, status_code=503, media_type=busy.content_type, headers={"Retry-After": "1"})
        return error_response(503, "no healthy worker to take the request", headers={"Retry-After": "1"})

    async def _unless_gone(self, worker: Worker, work):
        """Await `work`, giving up (_WorkerFailed) if the worker is marked down meanwhile."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(worker.gone.wait())
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
        if not task.done():
            raise _WorkerFailed("marked down while the request waited on it")
        return task.result()

    async def _send(
        self, worker: Worker, endpoint: str, path: str, raw: bytes, body: dict, fields, headers: dict
    ) -> _Answer | _OpenStream:
        """A whole answer, or a stream opened up to its first event with content; a worker slower
        than the settings' timeouts, or answering more than their bounds, failed (WORKER_ERRORS)."""
        s = self.settings
        if self.prefill is not None:
            transfer_id = await self.prefill.park(self.session, endpoint, raw, fields, worker.url)
            if transfer_id:
                body = {**body, "kv_transfer_id": transfer_id}
        # never redirected: the client's key and prompt go only to the worker the router chose
        post = self.session.post(f"{worker.url}{path}", json=body, headers=headers, allow_redirects=False)
        upstream = await asyncio.wait_for(post, s.first_byte_timeout_s)
        if 300 <= upstream.status < 400:
            upstream.close()
            raise _WorkerFailed(f"answered a redirect ({upstream.status})")
        try:
            if fields.stream and upstream.status == 200:
                events = sse_events(upstream, s.max_response_bytes, s.first_byte_timeout_s, s.idle_timeout_s)
                held = []
                async for event in events:
                    held.append(event)
                    if not is_preamble(event):
                        break
                return _OpenStream(upstream, events, held)
            data = await read_bounded(upstream, s.max_response_bytes, s.idle_timeout_s)
        except BaseException:
            upstream.close()  # also a client's hang-up: the closed connection aborts the request upstream
            raise
        upstream.release()
        return _Answer(upstream.status, upstream.headers.get("Content-Type"), data)

    def _relay(self, worker: Worker, lease: Lease, opened: _OpenStream, drop_usage: bool) -> StreamingResponse:
        def keep(event: bytes) -> bool:
            usage = usage_chunk(event)
            if usage is None:
                return True
            self._count_usage(worker, usage)
            return not drop_usage

        async def relay() -> AsyncIterator[bytes]:
            try:
                for event in opened.held:
                    if keep(event):
                        yield event
                async for event in opened.events:
                    if keep(event):
                        yield event
            except WORKER_ERRORS as e:  # past the first token nothing can move: the client hears why
                self.workers.mark_down(worker, f"a stream broke: {type(e).__name__}")
                yield error_event(f"the worker failed mid-stream: {type(e).__name__}")

        def close() -> None:
            lease.release()
            opened.upstream.close()  # a client gone mid-stream: the closed connection aborts it upstream

        return _Relay(relay(), on_close=close)

    @staticmethod
    def _count_usage(worker: Worker, usage: dict | None) -> None:
        if usage is not None:
            cached, prompt = cached_and_prompt_tokens(usage)
            worker.prefix_tokens_hit += cached
            worker.prompt_tokens += prompt
