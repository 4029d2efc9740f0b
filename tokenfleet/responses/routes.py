"""The Responses API's routes: create (streamed as typed events, or whole), read, delete, cancel."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenfleet.api.http import read_json, until_disconnect
from tokenfleet.gateway.app import relay_headers
from tokenfleet.gateway.gateway import Gateway
from tokenfleet.responses.service import ResponseService, Running
from tokenfleet.responses.store import ResponseStore
from tokenfleet.store.db import Database


def add_response_routes(app: FastAPI, gateway: Gateway, db: Database) -> ResponseService:
    service = ResponseService(gateway, ResponseStore(db))

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        caller = await gateway.auth.caller(request)
        body = await read_json(request)
        # a client that leaves while its request waits for room gives the room back
        running = await until_disconnect(request, service.create(caller, body))
        headers = await relay_headers(gateway, running.relay)
        if isinstance(body, dict) and body.get("stream"):
            return gateway.streams.sse(running.relay.request_id, 0, headers)
        await until_disconnect(request, _whole(running))
        return JSONResponse(running.format.snapshot(), headers=headers)

    @app.get("/v1/responses/{response_id}")
    async def get(response_id: str, request: Request) -> dict:
        return await service.get(await gateway.auth.caller(request), response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> dict:
        return await service.delete(await gateway.auth.caller(request), response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, request: Request) -> dict:
        return await service.cancel(await gateway.auth.caller(request), response_id)

    return service


async def _whole(running: Running) -> None:
    """Waits for the whole response; a client that leaves meanwhile stops it."""
    try:
        await asyncio.shield(running.relay.finished.wait())
    except asyncio.CancelledError:
        running.relay.cancel("disconnect")
        raise
