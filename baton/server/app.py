"""The OpenAI-compatible HTTP app (FastAPI): routes, errors in OpenAI's shape, key and size guard."""

from __future__ import annotations

import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from baton.config import ServerConfig
from baton.engine.async_engine import AsyncEngine
from baton.handoff.transport import SPAN_MEDIA_TYPE, SpanStore
from baton.server.metrics import ServerMetrics
from baton.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from baton.server.serving import OpenAIServing
from baton.tokenizer import apply_chat_template


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, status, param), status_code=status)


class Guard:
    """Pure ASGI middleware: 413 for bodies over the limit (declared or streamed), 401 without the key."""

    def __init__(self, app, max_bytes: int, api_key: str | None, max_span_bytes: int) -> None:
        self.app, self.api_key = app, api_key
        self.limits = {"/v1/internal/kv": max_span_bytes}
        self.default_limit = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        max_bytes = self.limits.get(scope["path"], self.default_limit)
        if self.api_key and scope["path"].startswith("/v1"):
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {self.api_key}":
                return await _error(401, "invalid or missing API key", "authentication_error")(scope, receive, send)
        declared = headers.get(b"content-length")
        too_big = _error(413, f"request body exceeds {max_bytes} bytes", "invalid_request_error")
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


def build_app(async_engine: AsyncEngine, config: ServerConfig, model_name: str) -> FastAPI:
    engine = async_engine.engine
    metrics = ServerMetrics(async_engine)
    served = config.served_model_name or model_name
    spans = SpanStore()
    serving = OpenAIServing(async_engine, metrics, served, spans)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.stop()

    app = FastAPI(title="baton", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return _error(e.status, e.message, e.type, e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        return _error(400, f"{param + ': ' if param else ''}{first.get('msg')}", "invalid_request_error", param)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, e: ValueError):
        return _error(400, str(e), "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        return _error(500, f"internal error: {type(e).__name__}", "server_error")

    def check_model(name: str | None) -> None:
        if name is not None and name != served:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{served}'", param="model")

    @app.get("/health")
    async def health():
        return Response(status_code=200 if async_engine.running else 503)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": served,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "baton",
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        check_model(body.model)
        return await serving.completion(body, _request_id("cmpl"))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        check_model(body.model)
        return await serving.chat(body, _request_id("chatcmpl"))

    @app.post("/v1/internal/prefill")
    async def internal_prefill(request: Request, endpoint: str = "completions", format: str = "grouped"):
        """Prefill only and answer with the prompt's KV span (the router's first leg)."""
        if config.kv_role == "decode":
            raise APIError(404, "this worker's kv_role is decode: it does not export KV")
        if endpoint not in ("completions", "chat") or format not in ("grouped", "dense"):
            raise APIError(400, "endpoint must be completions or chat, format grouped or dense")
        model = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
        try:
            body = model.model_validate_json(await request.body())
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        check_model(body.model)
        blob = await serving.prefill(body, _request_id("prefill"), format)
        return Response(blob, media_type=SPAN_MEDIA_TYPE)

    @app.post("/v1/internal/kv")
    async def internal_kv(request: Request):
        """Park a KV span until the request naming its transfer id arrives (the router's second leg)."""
        if config.kv_role == "prefill":
            raise APIError(404, "this worker's kv_role is prefill: it does not import KV")
        return {"kv_transfer_id": spans.put(await request.body())}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        if body.messages is not None:
            ids = apply_chat_template(engine.tokenizer, [m.as_template_dict() for m in body.messages])
        elif body.prompt is not None:
            ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "give either prompt or messages", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        if any(t >= engine.model_config.vocab_size for t in body.tokens):
            raise APIError(400, f"token ids must be below {engine.model_config.vocab_size}", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(
        Guard, max_bytes=config.max_request_bytes, api_key=config.api_key, max_span_bytes=config.max_kv_span_bytes
    )
    return app


def _request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
