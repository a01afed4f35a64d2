"""The chat page at `/` (`--no-ui`: none): static files shipped in the package (baton/server/static),
read once, no build step and nothing fetched from elsewhere. The page is public, as llama-server's
is; what it does goes through the API, under the API key typed in the page."""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import Response

from baton.http import APIError

_TYPES = {"index.html": "text/html", "chat.js": "text/javascript", "chat.css": "text/css"}
# only this origin's files; no framing (clickjacking); no inline script: model text never runs
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
        "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_chat_page(app: FastAPI) -> None:
    static = files("baton.server") / "static"
    pages = {name: (static / name).read_bytes() for name in _TYPES}

    def serve(name: str) -> Response:
        media = f"{_TYPES[name]}; charset=utf-8"
        return Response(pages[name], media_type=media, headers=_HEADERS)

    @app.get("/", include_in_schema=False)
    async def index():
        return serve("index.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def asset(name: str):
        if name not in pages or name == "index.html":
            raise APIError(404, f"no such file: {name[:64]}")
        return serve(name)
