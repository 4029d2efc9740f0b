"""HTTP plumbing shared by the replica and the gateway: JSON bodies, OpenAI-shaped errors, disconnects, uvicorn."""
from __future__ import annotations

import asyncio
import json

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tokenfleet.api.errors import APIError, bad_request

MAX_BODY_BYTES = 4 << 20


def install_error_handler(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)


async def read_json(request: Request) -> object:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from e


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


def run_http(app: FastAPI, host: str, port: int, drain_timeout_s: float) -> None:
    """Serves with uvloop + httptools. On SIGTERM uvicorn stops accepting connections and lets in-flight requests
    (streams included) finish for at most `drain_timeout_s` before it exits."""
    uvicorn.run(app, host=host, port=port, loop="uvloop", http="httptools", log_level="warning",
                timeout_graceful_shutdown=drain_timeout_s)
