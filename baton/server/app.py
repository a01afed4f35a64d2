"""The OpenAI-compatible HTTP app (FastAPI): routes, errors in OpenAI's shape, key and size guard."""

from __future__ import annotations

import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from baton.config import ServerConfig
from baton.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from baton.handoff.transport import SPAN_MEDIA_TYPE, SpanStore, SpanStoreFull
from baton.http import INTERNAL_PREFIX, APIError, Guard, error_response, install_error_handlers, unless_hung_up
from baton.server.metrics import ServerMetrics
from baton.server.openai_responses import ResponsesRequest, ResponseStore, create_response
from baton.server.page import add_chat_page
from baton.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from baton.server.serving import OpenAIServing
from baton.server.tools import plan_tools
from baton.tokenizer import apply_chat_template


def build_app(async_engine: AsyncEngine, config: ServerConfig, model_name: str) -> FastAPI:
    """The server's routes. Internal PD routes exist only for the engine's `kv_role` that needs
    them, and only behind the shared kv secret (the engine signs and checks spans with the same one)."""
    engine = async_engine.engine
    kv_transfer = engine.config.kv_transfer
    role = kv_transfer.kv_role
    internal_key = engine.config.internal_key(config.api_key)
    metrics = ServerMetrics(async_engine)
    served = config.served_model_name or model_name
    spans = SpanStore(
        max_bytes=kv_transfer.max_parked_kv_bytes,
        max_uploads=kv_transfer.max_kv_uploads,
        ttl_s=kv_transfer.kv_span_ttl_s,
    )
    serving = OpenAIServing(async_engine, metrics, served, spans, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.stop()

    app = FastAPI(title="baton", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    install_error_handlers(app, on_unexpected=lambda e: metrics.requests.labels("error").inc())

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, e: EngineDeadError):
        return error_response(503, str(e), headers={"Retry-After": "5"})

    @app.exception_handler(RequestFailedError)
    async def _failed(_: Request, e: RequestFailedError):
        return error_response(500, str(e))

    def check_model(name: str | None) -> None:
        if name is not None and name != served:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{served}'", param="model")

    @app.get("/health")
    async def health():
        healthy = async_engine.running and not async_engine.dead and not async_engine.stalled
        return Response(status_code=200 if healthy else 503)

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
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        return await unless_hung_up(request, serving.completion(body, _request_id("cmpl")), body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        return await unless_hung_up(request, serving.chat(body, _request_id("chatcmpl")), body.stream)

    response_store = ResponseStore()

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        check_model(body.model)
        work = create_response(serving, response_store, body, f"resp_{uuid.uuid4().hex}", served)
        return await unless_hung_up(request, work, body.stream)

    if role in ("prefill", "both"):

        @app.post(INTERNAL_PREFIX + "prefill")
        async def internal_prefill(request: Request, endpoint: str = "completions", format: str = "grouped"):
            """Prefill only and answer with the prompt's KV span (the router's first leg)."""
            if endpoint not in ("completions", "chat") or format not in ("grouped", "dense"):
                raise APIError(400, "endpoint must be completions or chat, format grouped or dense")
            model = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
            try:
                body = model.model_validate_json(await request.body())
            except ValidationError as e:
                raise RequestValidationError(e.errors()) from None
            check_model(body.model)
            blob = await unless_hung_up(request, serving.prefill(body, _request_id("prefill"), format), False)
            return Response(blob, media_type=SPAN_MEDIA_TYPE)

    if role in ("decode", "both"):

        @app.post(INTERNAL_PREFIX + "kv")
        async def internal_kv(request: Request):
            """Park a KV span until the request naming its transfer id arrives (the router's second leg).
            Parking checks only the sizes; the engine checks the signature and everything else at import."""
            try:
                return {"kv_transfer_id": await spans.receive(request.stream())}
            except SpanStoreFull as e:
                raise APIError(503, f"no room for a KV span now: {e}", headers={"Retry-After": "1"}) from None

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        if body.messages is not None:
            template = plan_tools([m.as_template_dict() for m in body.messages], None, None).messages
            ids = await serving.off_loop(apply_chat_template, engine.tokenizer, template)
        elif body.prompt is not None:
            ids = await serving.off_loop(
                lambda: engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            )
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
        return {"prompt": await serving.off_loop(engine.tokenizer.decode, body.tokens)}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if config.ui:
        add_chat_page(app)

    app.add_middleware(
        Guard,
        max_bytes=config.max_request_bytes,
        api_key=config.api_key,
        internal_key=internal_key,
        limits={INTERNAL_PREFIX + "kv": kv_transfer.max_kv_span_bytes},
    )
    return app


def _request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
