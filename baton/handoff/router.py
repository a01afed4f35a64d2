"""The PD front: prefill on one worker, decode on another, and fall back to a local prefill on the
decode worker whenever the prefill side or the handoff fails. Clients see plain OpenAI routes."""

from __future__ import annotations

import itertools
import json
import logging

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from baton.handoff.transport import SPAN_MEDIA_TYPE
from baton.http import Guard, error_response, install_error_handlers, unless_hung_up

logger = logging.getLogger(__name__)


class Router:
    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        span_format: str = "grouped",
        kv_secret: str | None = None,
    ) -> None:
        if not decode_urls:
            raise ValueError("the router needs at least one --decode worker")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self._next_prefill = itertools.cycle(self.prefill_urls) if self.prefill_urls else None
        self._next_decode = itertools.cycle(self.decode_urls)
        self.span_format = span_format
        self._internal_headers = {"Authorization": f"Bearer {kv_secret}"} if kv_secret else {}
        self.registry = CollectorRegistry()
        self.prefills = Counter(
            "baton_router_prefills", "Requests by where their prompt was prefilled", ["where"], registry=self.registry
        )
        self.handoff_failures = Counter(
            "baton_router_handoff_failures", "Handoffs abandoned, by stage", ["stage"], registry=self.registry
        )
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def _handoff(self, endpoint: str, raw: bytes, decode_url: str) -> str | None:
        """Prefill remotely and park the span on the decode worker; None means: prefill locally."""
        if self._next_prefill is None:
            return None
        prefill_url = next(self._next_prefill)
        try:
            async with self.session.post(
                f"{prefill_url}/v1/internal/prefill",
                params={"endpoint": endpoint, "format": self.span_format},
                data=raw,
                headers={"Content-Type": "application/json", **self._internal_headers},
                timeout=aiohttp.ClientTimeout(total=600),
            ) as r:
                if r.status != 200:
                    self.handoff_failures.labels("prefill").inc()
                    logger.warning("prefill worker %s answered %d: %s", prefill_url, r.status, (await r.text())[:200])
                    return None
                blob = await r.read()
            async with self.session.post(
                f"{decode_url}/v1/internal/kv",
                data=blob,
                headers={"Content-Type": SPAN_MEDIA_TYPE, **self._internal_headers},
                timeout=aiohttp.ClientTimeout(total=600),
            ) as r:
                if r.status != 200:
                    self.handoff_failures.labels("transfer").inc()
                    logger.warning("decode worker %s refused a span: %d", decode_url, r.status)
                    return None
                return (await r.json())["kv_transfer_id"]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as e:
            self.handoff_failures.labels("prefill").inc()
            logger.warning(
                "handoff via %s failed (%s: %s); prefilling on the decode worker", prefill_url, type(e).__name__, e
            )
            return None

    async def forward(self, endpoint: str, request: Request):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            return error_response(400, f"malformed JSON: {type(e).__name__}")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object")
        decode_url = next(self._next_decode)
        one_prompt = (
            endpoint == "chat"
            or isinstance(body.get("prompt"), str)
            or (isinstance(body.get("prompt"), list) and all(isinstance(t, int) for t in body["prompt"]))
        )
        simple = one_prompt and body.get("n", 1) == 1 and not body.get("logprobs") and not body.get("echo")
        body.pop("kv_transfer_id", None)  # a client never names a parked span: only this router does
        transfer_id = await self._handoff(endpoint, raw, decode_url) if simple else None
        self.prefills.labels("remote" if transfer_id else "local").inc()
        if transfer_id:
            body["kv_transfer_id"] = transfer_id
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            upstream = await self.session.post(f"{decode_url}{path}", json=body, headers=headers)
        except (aiohttp.ClientError, TimeoutError) as e:
            return error_response(502, f"decode worker unavailable: {type(e).__name__}")
        if body.get("stream") and upstream.status == 200:

            async def relay():
                try:
                    async for chunk in upstream.content.iter_any():
                        yield chunk
                finally:
                    upstream.close()  # a client gone mid-stream: the closed connection aborts it upstream

            return StreamingResponse(relay(), media_type="text/event-stream")
        try:
            data = await upstream.read()
        finally:
            upstream.close()  # cancelled by a hang-up: closing tells the decode worker to abort
        return Response(data, status_code=upstream.status, media_type=upstream.headers.get("Content-Type"))


def build_router_app(router: Router, api_key: str | None = None, max_request_bytes: int = 4 << 20) -> FastAPI:
    """Clients' routes, behind the router's own key and body limit; every error in OpenAI's shape."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="baton router", lifespan=lifespan)
    app.state.router = router
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
        try:
            async with router.session.get(f"{router.decode_urls[0]}/v1/models", headers=headers) as r:
                return Response(await r.read(), status_code=r.status, media_type="application/json")
        except (aiohttp.ClientError, TimeoutError) as e:
            return error_response(502, f"decode worker unavailable: {type(e).__name__}")

    @app.get("/health")
    async def health():
        for url in router.decode_urls:
            try:
                async with router.session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return Response(status_code=200)
            except (aiohttp.ClientError, TimeoutError):
                continue
        return Response(status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(Guard, max_bytes=max_request_bytes, api_key=api_key)
    return app
