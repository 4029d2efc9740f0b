"""The public HTTP API around the Gateway: OpenAI-compatible completions (streamed as SSE with ids and
heartbeats), the native stream, resume with Last-Event-ID, cancel, /v1/models, /health, /metrics, the
operators' replica routes (list, drain) and fleet view under /admin/v1, and the pages for people (the chat page at /
and the operator console at /console, from tokenfleet.web)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
from collections.abc import Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenfleet.api.errors import APIError, bad_request, not_found, server_error
from tokenfleet.api.http import install_error_handler, method_not_allowed, read_json, until_disconnect
from tokenfleet.api.protocol import ChatCompletionRequest, CompletionRequest
from tokenfleet.gateway.admin import PREFIX, add_fleet_view, admin_guard
from tokenfleet.gateway.formats import CollectFormat
from tokenfleet.gateway.gateway import Gateway, ModelInfo
from tokenfleet.gateway.relay import Relay
from tokenfleet.router.pool import ModelPools
from tokenfleet.web.pages import mount_pages

__all__ = ["Gateway", "ModelInfo", "create_gateway_app"]
log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    gateway: Gateway = app.state.gateway
    tasks = [asyncio.create_task(service()) for service in gateway.services]
    # Everything built so far (models' tokenizers, ORM and pydantic machinery) lives as long as the process: out of
    # the collector's sight, a full collection no longer walks it (it took ~0.3 s, stalling every stream at once).
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        log.info("gateway stopping: %d closer(s) to run", len(gateway.closers))
        for close in gateway.closers:
            try:
                await close()
            except Exception:  # one that fails must not keep the rest (replicas' stop, the usage flush) from running
                log.exception(
                    "gateway shutdown: %s failed; going on with the rest", getattr(close, "__qualname__", close)
                )


def create_gateway_app(
    gateway: Gateway, extra_routes: Callable[[FastAPI], None] | None = None, admin_key: str | None = None
) -> FastAPI:
    app = FastAPI(title="tokenfleet gateway", docs_url="/docs", redoc_url=None, lifespan=lifespan)
    app.state.gateway = gateway
    install_error_handler(app)
    app.add_exception_handler(Exception, _unexpected_error)
    app.add_middleware(FrontDoor, gateway=gateway)
    _add_service_routes(app, gateway)
    _document_completion_routes(app, gateway)
    _add_stream_routes(app, gateway)
    _add_replica_routes(app, gateway, admin_key)
    add_fleet_view(app, gateway, admin_key)
    if extra_routes is not None:
        extra_routes(app)
    mount_pages(app)
    return app


EVENT_ID = re.compile(r"[0-9]{1,18}")  # an event's id in a stream; 18 digits is far more than any stream holds

# the completion routes, served by FrontDoor itself: path -> (kind, native format)
COMPLETIONS = {
    "/v1/chat/completions": ("chat", False),
    "/v1/completions": ("text", False),
    "/v1/generate": ("chat", True),
}


def _document_completion_routes(app: FastAPI, gateway: Gateway) -> None:
    """The completion routes as FastAPI routes too, so that /openapi.json and /docs show them with their request
    schemas; FrontDoor answers them before FastAPI's routing is reached."""

    @app.post("/v1/chat/completions", tags=["completions"], summary="Create a chat completion")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await completion(gateway, "chat", request)

    @app.post("/v1/completions", tags=["completions"], summary="Create a text completion")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await completion(gateway, "text", request)

    @app.post("/v1/generate", tags=["completions"], summary="A chat completion in the native stream format")
    async def generate(body: ChatCompletionRequest, request: Request) -> Response:
        return await completion(gateway, "chat", request, native=True)


class FrontDoor:
    """Plain ASGI middleware: counts every /v1/ request by endpoint and status, and serves the completion routes
    without FastAPI's routing and dependency machinery (they are the gateway's hot path). Everything else goes on
    to the FastAPI app."""

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app, self.gateway = app, gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        completion = COMPLETIONS.get(path)
        send = self._counting(scope, send, path if completion else None)
        if completion is None:
            await self.app(scope, receive, send)
        elif scope["method"] != "POST":
            refusal = method_not_allowed(scope["method"], path, ["POST"])
            await JSONResponse(refusal.body(), refusal.status, refusal.headers)(scope, receive, send)
        else:
            await self._completion(scope, receive, send, *completion)

    def _counting(self, scope: Scope, send: Send, endpoint: str | None) -> Send:
        requests = self.gateway.metrics.requests

        def counting_send(message: Message):
            if message["type"] == "http.response.start":
                route = scope.get("route")
                label = endpoint or (route.path if route is not None else "unknown")
                requests.labels(label, str(message["status"])).inc()
            return send(message)

        return counting_send

    async def _completion(self, scope: Scope, receive: Receive, send: Send, kind: str, native: bool) -> None:
        try:
            response = await completion(self.gateway, kind, Request(scope, receive), native)
        except APIError as e:
            response = error_response(e)
        except Exception as e:  # a bug or a failing dependency: still OpenAI's shape, never a plain-text 500
            log.exception("completion failed")
            response = error_response(server_error(f"the gateway failed: {type(e).__name__}"))
        await response(scope, receive, send)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers or None)


async def _unexpected_error(_: Request, error: Exception) -> Response:
    return error_response(server_error(f"the gateway failed: {type(error).__name__}"))


RESUMABLE_HEADER = "x-tokenfleet-resumable"  # "true": a stream's events carry their ids, to resume from one


async def completion(gateway: Gateway, kind: str, request: Request, native: bool = False) -> Response:
    caller = await gateway.auth.caller(request)
    body = await read_json(request)
    affinity = request.headers.get("x-conversation-id")  # soft affinity: a conversation's turns, one replica
    admit = gateway.admit(kind, body, caller, native, affinity, request.headers.get("x-tokenfleet-mode"))
    # a client that leaves while its request waits for room gives the room (and its reservation) back
    relay = await until_disconnect(request, admit)
    headers = await relay_headers(gateway, relay)
    if isinstance(relay.format, CollectFormat):
        return JSONResponse(await until_disconnect(request, gateway.streams.complete(relay, kind)), headers=headers)
    # OpenAI's streams carry no `id:` lines, and clients such as vLLM's benchmark cannot parse them: the ids
    # (for a resume with Last-Event-ID) only when the client asks, and always on our native format
    event_ids = native or request.headers.get(RESUMABLE_HEADER, "").strip().lower() in ("1", "true", "yes")
    return gateway.streams.sse(relay.request_id, 0, headers, event_ids=event_ids)


def _add_service_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.render_metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/health")
    async def health() -> dict:
        """The process is alive (a liveness probe); whether it can serve is /ready."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Whether the gateway can serve: per model, its replicas that take requests (not draining, not ejected);
        503 when no model has one."""
        serving = {name: _serving_replicas(pools) for name, pools in gateway.router.models.items()}
        if any(serving.values()):
            return JSONResponse({"status": "ready", "replicas": serving})
        error = APIError(503, "no replica is taking requests", "service_unavailable", code="no_replica")
        return JSONResponse({"status": "not_ready", "replicas": serving, **error.body()}, status_code=503)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        await gateway.auth.caller(request)  # a 401 without a valid key, like every public endpoint
        listing = gateway.router.catalog.listing()
        for entry in listing:
            info = gateway.models.get(entry.get("alias_of") or entry["id"])
            if info is not None:
                entry["max_model_len"] = info.max_model_len
        return {"object": "list", "data": listing}


def _serving_replicas(pools: ModelPools) -> int:
    """Replicas taking requests and answering them: not draining, not ejected, their last check or request fine
    (the ejection cap can keep a failing replica's breaker closed when it is the last one)."""
    health = pools.health.snapshot()
    return sum(
        not r.draining
        and health.get(r.name, {}).get("state", "closed") != "open"
        and health.get(r.name, {}).get("consecutive_failures", 0) == 0
        for r in pools.replicas.values()
    )


async def relay_headers(gateway: Gateway, relay: Relay) -> dict[str, str]:
    """x-request-id, the rate-limit headers of the reservation, the token that lets a browser's EventSource (which
    cannot send an Authorization header) resume this one stream, and whether it can be resumed: known once the
    stream's open is answered (the relay does not wait for that; its first event usually does not either)."""
    headers = {
        "x-request-id": relay.request_id,
        "x-resume-token": gateway.streams.resume_token(relay.request_id, relay.owner),
        "x-tokenfleet-model": relay.route.model,
    }
    deprecated = gateway.router.catalog.models[relay.route.model].deprecated_on
    if deprecated is not None:
        headers["x-tokenfleet-deprecated-on"] = deprecated.isoformat()
    await gateway.buffer.settled(relay.request_id)
    if not gateway.buffer.resumable(relay.request_id):  # served, but Redis could not keep it for a resume
        headers["x-tokenfleet-resume"] = "unavailable"
    return {**(relay.rate_limit_headers or {}), **headers}


def _add_stream_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.get("/v1/requests/{request_id}/stream")
    async def resume(request_id: str, request: Request) -> Response:
        last = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or "0"
        if not EVENT_ID.fullmatch(last):  # not str.isdigit(): "²" and "１" are digits that int() refuses or reads
            raise bad_request(
                "Last-Event-ID must be the integer id of an event (ASCII digits, at most 18)", param="Last-Event-ID"
            )
        token = request.query_params.get("resume_token")
        tenant = None if token is not None else (await gateway.auth.caller(request)).tenant
        await gateway.streams.check_resumable(request_id, token, tenant)
        gateway.metrics.resumes.inc()
        return gateway.streams.sse(request_id, int(last))

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel(request_id: str, request: Request) -> dict:
        caller = await gateway.auth.caller(request)
        return {"id": request_id, "object": "request.cancel", "cancelled": gateway.streams.cancel(request_id, caller)}


def _add_replica_routes(app: FastAPI, gateway: Gateway, admin_key: str | None) -> None:
    """Operators: see every replica's pool, load and health; drain one (no new requests; in-flight ones finish)."""
    router = APIRouter(prefix=PREFIX, dependencies=[Depends(admin_guard(admin_key))])

    @router.get("/replicas")
    async def replicas() -> dict:
        return {"object": "list", "data": gateway.router.snapshot()}

    @router.post("/replicas/drain")
    async def drain(request: Request) -> dict:
        body = await read_json(request)
        name, draining = (body.get("replica"), body.get("draining", True)) if isinstance(body, dict) else (None, 1)
        if not isinstance(name, str) or not isinstance(draining, bool):
            raise bad_request('send {"replica": <name or URL>, "draining": true|false}', param="replica")
        if not any(pools.set_draining(name, draining) for pools in gateway.router.models.values()):
            raise not_found(f"no replica {name!r}", param="replica")
        return {"replica": name, "draining": draining}

    app.include_router(router)
