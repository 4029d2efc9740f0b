"""HTTP plumbing shared by the replica and the gateway: JSON bodies, OpenAI-shaped errors, disconnects, uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
from collections.abc import AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenfleet.api.errors import APIError, bad_request

MAX_BODY_BYTES = 4 << 20
MAX_JSON_DEPTH = 64  # objects and arrays inside each other; OpenAI-style bodies need fewer than 10
_NESTED = {str, dict, list}  # what json.loads makes that may hold a bad string
_SURROGATE = re.compile("[\ud800-\udfff]")


def install_error_handler(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """The framework's own 404 and 405 in OpenAI's shape, which the SDKs read (not {"detail": ...})."""
        return await api_error(request, _framework_error(request, exc))


def _framework_error(request: Request, exc: StarletteHTTPException) -> APIError:
    route = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        return APIError(404, f"no route {route}; see /docs for the API", code="unknown_route")
    if exc.status_code == 405:
        return method_not_allowed(request.method, request.url.path, _methods_for(request))
    return APIError(
        exc.status_code, str(exc.detail), "server_error" if exc.status_code >= 500 else "invalid_request_error"
    )


def method_not_allowed(method: str, path: str, allowed: list[str]) -> APIError:
    methods = ", ".join(allowed) or "none"
    return APIError(
        405,
        f"method not allowed: {method} {path} (allowed: {methods})",
        code="method_not_allowed",
        headers={"allow": methods},
    )


def _methods_for(request: Request) -> list[str]:
    """The methods the app's routes take at this path."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        regex, route_methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if regex is not None and route_methods and regex.match(request.url.path):
            methods |= set(route_methods)
    return sorted(methods)


async def read_json(request: Request) -> object:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
    return parse_json(body)


def parse_json(body: bytes) -> object:
    """A request body as JSON whose every string is valid Unicode, nested at most MAX_JSON_DEPTH levels."""
    try:
        # strictly: json.loads(bytes) would let UTF-8-encoded surrogates (ED A0 80) through
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8: {e}") from e
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from e
    except RecursionError:
        raise _too_deep() from None
    _check_strings_and_depth(value)
    return value


def _check_strings_and_depth(body: object) -> None:
    """Without recursion: whatever reads the body later (validation, templates, json.dumps) recurses. A bad string
    is reported by the top-level field that holds it."""
    if type(body) is str:
        _check_text(body, None)
    stack: list[tuple[object, int, str | None]] = [(body, 1, None)]
    while stack:
        container, depth, field = stack.pop()
        if type(container) is dict:
            for key, item in container.items():
                _check_text(key, field)
                _check_item(item, depth, key if depth == 1 else field, stack)
        elif type(container) is list:
            for item in container:
                if type(item) in _NESTED:
                    _check_item(item, depth, field, stack)


def _check_item(item: object, depth: int, field: str | None, stack: list) -> None:
    if type(item) is str:
        _check_text(item, field)
    elif type(item) in _NESTED:
        if depth >= MAX_JSON_DEPTH:
            raise _too_deep()
        stack.append((item, depth + 1, field))


def _check_text(text: str, field: str | None) -> None:
    if not text.isascii() and _SURROGATE.search(text):
        where = f"the text of {field}" if field else "the request body's text"
        raise bad_request(
            f"{where} is not valid Unicode: it has a lone surrogate (such as \\ud800)", param=field, code="invalid_text"
        )


def _too_deep() -> APIError:
    return bad_request(f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep")


async def until_disconnect(request: Request, work) -> dict:
    """Awaits a non-streamed response, cancelling it (and so its engine requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            raise APIError(499, "client closed the request", code="client_closed_request")


def within_lifespan(app: FastAPI, context: Callable[[], contextlib.AbstractAsyncContextManager[object]]) -> None:
    """Runs `context()` inside the app's lifespan (entered after the app's own startup, left before its shutdown)."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app_: FastAPI) -> AsyncIterator[object]:
        async with inner(app_) as state, context():
            yield state

    app.router.lifespan_context = lifespan  # type: ignore[assignment]


def run_http(app: FastAPI, host: str, port: int, drain_timeout_s: float, reuse_port: bool = False) -> None:
    """Serves with uvloop + httptools. On SIGTERM uvicorn stops accepting connections and lets in-flight requests
    (streams included) finish for at most `drain_timeout_s` before it exits. reuse_port: several processes listen
    on the same port (SO_REUSEPORT) and the kernel spreads the connections over them."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        timeout_graceful_shutdown=drain_timeout_s,
    )
    server = uvicorn.Server(config)
    server.run(sockets=[_reusable_socket(host, port)] if reuse_port else None)


def _reusable_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock
