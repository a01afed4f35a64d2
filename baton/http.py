"""What the API server and the router share: OpenAI-shaped errors, the key and size guard, the
hang-up watch, and bounded reads of another server's answer."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable

import aiohttp
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

INTERNAL_PREFIX = "/v1/internal/"
ADMIN_PREFIX = "/v1/router/"  # the router's worker set: a privilege apart from the client API key
KEYED_PATHS = ("/v1", "/tokenize", "/detokenize")  # what the API key guards (/health and /metrics stay open)
_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int, message: str, type_: str | None = None, param: str | None = None, headers: dict | None = None
) -> JSONResponse:
    type_ = type_ or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(error_body(message, type_, status, param), status_code=status, headers=headers)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str | None = None,
        param: str | None = None,
        headers: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


def _param(loc) -> str | None:
    """A validation error's location as a dotted path, without pydantic's union-member names."""
    parts = [str(x) for x in loc if x != "body" and not (isinstance(x, str) and ("[" in x or x in _TYPE_NAMES))]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI, on_unexpected: Callable[[Exception], None] | None = None) -> None:
    """Every error leaves in OpenAI's shape; an unexpected one is a 500 that names only its type."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError):
        errors = e.errors() or [{"loc": (), "msg": "invalid request"}]
        first = max(errors, key=lambda err: len(err.get("loc", ())))  # the deepest: a union's real culprit
        param = _param(first.get("loc", ()))
        return error_response(400, f"{param + ': ' if param else ''}{first.get('msg')}", param=param)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, e: ValueError):
        return error_response(400, str(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        if on_unexpected is not None:
            on_unexpected(e)
        return error_response(500, f"internal error: {type(e).__name__}")


def _key_matches(headers: dict[bytes, bytes], key: str) -> bool:
    sent = headers.get(b"authorization", b"")
    return hmac.compare_digest(sent, f"Bearer {key}".encode())


class Guard:
    """Pure ASGI middleware: 401 without the right key, 413 for bodies over the limit (declared or
    streamed). Public /v1 routes and /tokenize, /detokenize take `api_key`; internal routes
    (/v1/internal/...) take `internal_key` and are refused outright when there is none; the
    router's admin routes (/v1/router/...) take `admin_key` alone."""

    def __init__(
        self,
        app,
        max_bytes: int,
        api_key: str | None,
        internal_key: str | None = None,
        limits: dict[str, int] | None = None,
        admin_key: str | None = None,
    ) -> None:
        self.app, self.api_key, self.internal_key, self.admin_key = app, api_key, internal_key, admin_key
        self.limits = limits or {}
        self.default_limit = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        path = scope["path"]
        if path.startswith(INTERNAL_PREFIX):
            if self.internal_key is None or not _key_matches(headers, self.internal_key):
                return await error_response(401, "internal route: missing or wrong kv secret", "authentication_error")(
                    scope, receive, send
                )
        elif self.admin_key is not None and path.startswith(ADMIN_PREFIX):
            if not _key_matches(headers, self.admin_key):
                return await error_response(401, "admin route: missing or wrong admin key", "authentication_error")(
                    scope, receive, send
                )
        elif self.api_key and path.startswith(KEYED_PATHS) and not _key_matches(headers, self.api_key):
            return await error_response(401, "invalid or missing API key", "authentication_error")(scope, receive, send)
        max_bytes = self.limits.get(path, self.default_limit)
        declared = headers.get(b"content-length")
        too_big = error_response(413, f"request body exceeds {max_bytes} bytes")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            return await too_big(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await too_big(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


async def unless_hung_up(request: Request, work: Awaitable, streaming: bool):
    """Run a request's work, cancelling it (and so aborting it in the engine, freeing its KV) as
    soon as the client hangs up. A streamed response is watched by the response itself later."""
    if streaming:
        return await work
    await request.body()  # read (and cached) before the watcher below takes over `receive`
    task = asyncio.ensure_future(work)

    async def hung_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled():
        return error_response(499, "the client closed the connection")
    return task.result()


class UpstreamTooLarge(aiohttp.ClientPayloadError):
    """A worker's answer (or one event of its stream) passed the router's bound."""


async def read_bounded(upstream: aiohttp.ClientResponse, max_bytes: int, idle_s: float) -> bytes:
    """A whole body of at most `max_bytes`, each read within `idle_s` (asyncio.TimeoutError)."""
    parts, n = [], 0
    while chunk := await asyncio.wait_for(upstream.content.readany(), idle_s):
        n += len(chunk)
        if n > max_bytes:
            raise UpstreamTooLarge(f"an answer of more than {max_bytes} bytes")
        parts.append(chunk)
    return b"".join(parts)
