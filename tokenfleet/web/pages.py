"""Serves the pages and their assets. The pages are plain files: every piece of data reaches them through the same
HTTP API that other clients use, so nothing here touches a request's path through the gateway."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

STATIC = Path(__file__).parent / "static"
ASSETS_PREFIX = "/web"

# Model output and titles are rendered as text, never markup; the policy is the second line of defence: no inline
# script, no other origin, no plugins, no framing.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
}
# revalidated on every load (an upgraded gateway never serves an old page's scripts), cheap with the ETag
PAGE_HEADERS = {**SECURITY_HEADERS, "cache-control": "no-cache"}

PAGES = {"/": "chat.html", "/chat": "chat.html", "/console": "console.html"}


class Assets(StaticFiles):
    """The pages' scripts and styles, with the same headers as the pages."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message) -> None:
            if message["type"] == "http.response.start":
                extra = [(k.encode(), v.encode()) for k, v in PAGE_HEADERS.items()]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await super().__call__(scope, receive, with_headers)


def mount_pages(app: FastAPI) -> None:
    """GET / and /chat: the chat page; /console: the operator console; /web/...: their scripts and styles."""
    for path, name in PAGES.items():
        _add_page(app, path, STATIC / name)
    app.mount(ASSETS_PREFIX, Assets(directory=STATIC), name="web")


def _add_page(app: FastAPI, path: str, file: Path) -> None:
    async def page() -> FileResponse:
        return FileResponse(file, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    app.add_api_route(path, page, methods=["GET", "HEAD"], include_in_schema=False, name=f"page:{path}")
