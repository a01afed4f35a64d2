"""The router's HTTP app: clients' OpenAI routes, the worker-set admin routes, /health, /metrics;
all /v1 routes behind the router's own key and body limit, every error in OpenAI's shape."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from baton.http import (
    ADMIN_PREFIX,
    APIError,
    Guard,
    error_response,
    install_error_handlers,
    read_bounded,
    unless_hung_up,
)
from baton.router.metrics import RouterCollector
from baton.router.proxy import Router


async def _url_of(request: Request) -> object:
    """The "url" of an admin request's JSON object body (validated by the worker set)."""
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise APIError(400, f"malformed JSON: {type(e).__name__}") from None
    if not isinstance(body, dict) or "url" not in body:
        raise APIError(400, 'the body must be a JSON object {"url": "http://host:port"}', param="url")
    return body["url"]


def build_router_app(
    router: Router, api_key: str | None = None, max_request_bytes: int = 4 << 20, admin_key: str | None = None
) -> FastAPI:
    """The worker-set routes exist only with an `admin_key`, and take that key alone: a tenant's
    API key cannot add the host that would then receive other tenants' prompts and the KV secret."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="baton router", lifespan=lifespan)
    app.state.router = router
    registry = CollectorRegistry()
    registry.register(RouterCollector(router))
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await unless_hung_up(request, router.forward("completions", request), streaming=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await unless_hung_up(request, router.forward("chat", request), streaming=False)

    @app.get("/v1/models")
    async def models(request: Request):
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        for worker in router.workers.up():
            try:
                timeout = aiohttp.ClientTimeout(total=10)
                url = f"{worker.url}/v1/models"
                async with router.session.get(url, headers=headers, timeout=timeout, allow_redirects=False) as r:
                    data = await read_bounded(r, 1 << 20, 10)
                    return Response(data, status_code=r.status, media_type="application/json")
            except (aiohttp.ClientError, TimeoutError):
                continue
        return error_response(503, "no healthy worker")

    if admin_key is not None:

        @app.get(ADMIN_PREFIX + "workers")
        async def list_workers():
            return {"object": "list", "policy": router.settings.policy, "data": [w.stats() for w in router.workers]}

        @app.post(ADMIN_PREFIX + "workers")
        async def add_worker(request: Request):
            """Join a worker on an allowed host: it takes traffic once its /health answered 200."""
            worker = await router.workers.add(await _url_of(request))
            return worker.stats()

        @app.delete(ADMIN_PREFIX + "workers")
        async def remove_worker(request: Request):
            """Out of routing at once; requests already on it finish there."""
            return {"url": router.workers.remove(await _url_of(request)), "removed": True}

    @app.get("/health")
    async def health():
        return Response(status_code=200 if router.workers.up() else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(Guard, max_bytes=max_request_bytes, api_key=api_key, admin_key=admin_key)
    return app
