"""The public API: validation, token counting, the safety hook, relaying replica streams as SSE with ids and
heartbeats, resume with Last-Event-ID, and cancellation."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenfleet.api.errors import bad_request, not_found
from tokenfleet.api.http import install_error_handler, read_json, until_disconnect
from tokenfleet.api.protocol import ChatCompletionRequest, CompletionRequest, parse, prompt_token_ids
from tokenfleet.api.sse import sse_event
from tokenfleet.config import StreamSettings
from tokenfleet.gateway.aggregate import aggregate
from tokenfleet.dispatch.overload import Plan
from tokenfleet.gateway.admission import Admission, Admitted
from tokenfleet.gateway.auth import Authenticator, Caller
from tokenfleet.gateway.formats import CollectFormat, EventFormat, NativeFormat, OpenAIFormat
from tokenfleet.gateway.metrics import GatewayMetrics
from tokenfleet.gateway.relay import Relay
from tokenfleet.gateway.resume import ResumeBuffer
from tokenfleet.gateway.safety import SafetyHook, allow_all
from tokenfleet.gateway.sse_response import SlowClient, SSEResponse
from tokenfleet.gateway.upstream import Upstream
from tokenfleet.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)
@dataclass
class ModelInfo:
    name: str
    tokenizer: Tokenizer
    max_model_len: int


class Gateway:
    def __init__(self, model: ModelInfo, upstreams: list[Upstream], buffer: ResumeBuffer, admission: Admission,
                 auth: Authenticator, settings: StreamSettings | None = None, safety: SafetyHook = allow_all,
                 resume_secret: bytes | None = None) -> None:
        if not upstreams:
            raise ValueError("the gateway needs at least one replica")
        self.model, self.upstreams, self.buffer = model, upstreams, buffer
        self.admission, self.auth = admission, auth
        self.settings, self.safety = settings or StreamSettings(), safety
        self.relays: dict[str, Relay] = {}
        self.in_flight = {u.name: 0 for u in upstreams}
        self.metrics = GatewayMetrics(lambda: sum(not r.finished.is_set() for r in self.relays.values()),
                                      admission)
        self.extra_metrics: Callable[[], bytes] | None = None  # e.g. the in-process replica's, when embedded
        self._background: set[asyncio.Task] = set()
        self.resume_secret = resume_secret or secrets.token_bytes(32)
        self.services: list[Callable[[], Awaitable[None]]] = []  # background loops, run while the app serves
        self.closers: list[Callable[[], Awaitable[None]]] = []  # called once at shutdown

    # --- admission ----------------------------------------------------------------------------------------

    def count_prompt(self, kind: str, req: ChatCompletionRequest | CompletionRequest) -> list[list[int]]:
        """Tokenizes the prompt(s) before anything reaches a replica, and checks them against the context window."""
        if req.model != self.model.name:
            raise not_found(f"The model `{req.model}` does not exist", param="model", code="model_not_found")
        prompts = prompt_token_ids(req, self.model.tokenizer)
        max_tokens, param = _max_tokens(kind, req), "messages" if kind == "chat" else "prompt"
        limit = self.model.max_model_len
        for prompt in prompts:
            if not prompt:
                raise bad_request("the prompt is empty", param=param)
            if len(prompt) + (max_tokens or 1) > limit:
                raise bad_request(f"This model's maximum context length is {limit} tokens; you requested "
                                  f"{len(prompt) + (max_tokens or 1)} tokens ({len(prompt)} in the prompt, "
                                  f"{max_tokens or 1} to generate)", param=param, code="context_length_exceeded")
        return prompts

    async def admit(self, kind: str, body: object, caller: Caller, native: bool = False) -> Relay:
        """Validate, count, apply the overload plan, reserve quota, then wait for room (the safety check runs
        meanwhile) and start generating. Anything that fails after the reservation gives it back."""
        req = parse(ChatCompletionRequest if kind == "chat" else CompletionRequest, body)
        prompts = self.count_prompt(kind, req)
        plan = self.admission.plan(caller)
        body = _apply_plan(body, kind, req, plan, caller.tier.priority)
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        choices = req.n * len(prompts)
        tokens = self.admission.expected_tokens(caller, sum(map(len, prompts)), choices, _max_tokens(kind, req)
                                                if plan.max_tokens_cap is None else body["max_tokens"])
        admitted = await self.admission.reserve(request_id, caller, tokens)
        queued = asyncio.ensure_future(self.admission.queue(admitted, tokens))
        try:
            refusal = await self.safety(body, prompts[0])
            if refusal:
                raise bad_request(refusal, code="content_filter")
            await queued
            fmt = _event_format(request_id, req, native)
            return await self.start_relay(await self.choose_upstream(), kind, body, fmt, admitted, choices)
        except BaseException:
            queued.cancel()
            self._spawn(self._give_back(queued, admitted))
            raise

    async def _give_back(self, queued: asyncio.Future, admitted: Admitted) -> None:
        await asyncio.gather(queued, return_exceptions=True)
        await self.admission.leave(admitted, None)

    async def choose_upstream(self) -> Upstream:
        """Least in-flight work first (the router issue replaces this with cache-aware, load-reported choice)."""
        return min(self.upstreams, key=lambda u: self.in_flight[u.name])

    # --- relaying -----------------------------------------------------------------------------------------

    async def start_relay(self, upstream: Upstream, kind: str, body: dict, fmt: EventFormat,
                          admitted: Admitted | None = None, choices: int = 1) -> Relay:
        owner = admitted.caller.tenant if admitted else ""
        relay = Relay(fmt.request_id, self.buffer, fmt, self.settings.disconnect_grace_s, owner=owner,
                      rate_limit_headers=admitted.headers if admitted else None)
        self.relays[relay.request_id] = relay
        self.in_flight[upstream.name] += 1
        await relay.start(upstream.stream(kind, body))
        relay.task.add_done_callback(lambda _: self._relay_done(relay, upstream, admitted, choices))
        return relay

    def _relay_done(self, relay: Relay, upstream: Upstream, admitted: Admitted | None, choices: int) -> None:
        self.in_flight[upstream.name] -= 1
        if relay.cancel_reason:
            self.metrics.cancels.labels(relay.cancel_reason).inc()
        if admitted is not None:
            self._spawn(self.admission.leave(admitted, relay.usage, choices))
        loop = asyncio.get_running_loop()
        loop.call_later(self.settings.disconnect_grace_s + 60, self.relays.pop, relay.request_id, None)

    def _spawn(self, work) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def sse(self, request_id: str, after: int, headers: dict[str, str] | None = None) -> SSEResponse:
        relay = self.relays.get(request_id)
        if relay is not None:
            relay.reader_joined()

        def on_end(how: str) -> None:
            self.metrics.stream_endings.labels(how).inc()
            if relay is not None:
                relay.reader_left(disconnected=how == "disconnect")

        return SSEResponse(self._events(request_id, after, relay), {**(headers or {}), "x-request-id": request_id},
                           self.settings.ping_interval_s, self.settings.send_timeout_s, on_end)

    async def _events(self, request_id: str, after: int, relay: Relay | None):
        async for event in self.buffer.read(request_id, after):
            if relay is not None and relay.last_id - event.id > self.settings.max_lag_events:
                raise SlowClient(request_id)
            yield sse_event(event.data, event.id, event.event)

    async def complete(self, relay: Relay, kind: str) -> dict:
        """A non-streamed request: wait for the whole generation (cancelled if the client leaves), then answer."""
        try:
            await asyncio.shield(relay.finished.wait())
        except asyncio.CancelledError:
            relay.cancel("disconnect")
            raise
        fmt: CollectFormat = relay.format
        if fmt.failure is not None:
            raise fmt.failure
        response = aggregate(fmt.chunks, kind)
        response["id"] = relay.request_id
        return response

    def resume_token(self, request_id: str, owner: str) -> str:
        return hmac.new(self.resume_secret, f"{request_id}/{owner}".encode(), hashlib.sha256).hexdigest()

    async def resumable(self, request_id: str, request: Request) -> None:
        """Only the tenant that made a request may resume it (by its API key, or by the stream's resume token);
        anyone else learns nothing, not even that the stream exists."""
        token = request.query_params.get("resume_token")
        tenant = None if token is not None else (await self.auth.caller(request)).tenant
        owner = await self.buffer.owner(request_id)
        if owner is not None and token is not None:
            allowed = hmac.compare_digest(token, self.resume_token(request_id, owner))
        else:
            allowed = owner is not None and owner == tenant
        if not allowed:
            raise not_found(f"no stream {request_id!r} to resume (streams are kept for a few minutes)",
                            param="request_id")

    def cancel(self, request_id: str, caller: Caller) -> bool:
        relay = self.relays.get(request_id)
        if relay is None or relay.owner != caller.tenant:
            raise not_found(f"no request {request_id!r} (finished requests are kept for a few minutes)",
                            param="request_id")
        return relay.cancel("api")

    def render_metrics(self) -> bytes:
        return self.metrics.render() + (self.extra_metrics() if self.extra_metrics else b"")


def _max_tokens(kind: str, req: ChatCompletionRequest | CompletionRequest) -> int | None:
    return req.requested_max_tokens() if kind == "chat" else req.max_tokens


def _apply_plan(body: dict, kind: str, req: ChatCompletionRequest | CompletionRequest, plan: Plan,
                priority: int) -> dict:
    """The body the replica gets: the tier's priority class (never the client's own), and under overload a
    smaller max_tokens for free users."""
    body = {**body, "priority": priority}
    cap = plan.max_tokens_cap
    if cap is not None:
        requested = _max_tokens(kind, req)
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = cap if requested is None else min(requested, cap)
    return body


def _event_format(request_id: str, req: ChatCompletionRequest | CompletionRequest, native: bool) -> EventFormat:
    if native:
        return NativeFormat(request_id)
    if not req.stream:
        return CollectFormat(request_id)
    return OpenAIFormat(request_id, req.include_usage, req.continuous_usage)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    gateway: Gateway = app.state.gateway
    tasks = [asyncio.create_task(service()) for service in gateway.services]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for close in gateway.closers:
            await close()


def create_gateway_app(gateway: Gateway, extra_routes: Callable[[FastAPI], None] | None = None) -> FastAPI:
    app = FastAPI(title="tokenfleet gateway", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.gateway = gateway
    install_error_handler(app)
    _add_service_routes(app, gateway)
    _add_completion_routes(app, gateway)
    _add_stream_routes(app, gateway)
    if extra_routes is not None:
        extra_routes(app)
    return app


def _add_service_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        response = await call_next(request)
        if request.url.path.startswith("/v1/"):
            endpoint = request.scope.get("route").path if request.scope.get("route") else "unknown"
            gateway.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.render_metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": gateway.model.name, "object": "model", "created": 0,
                                            "owned_by": "tokenfleet", "max_model_len": gateway.model.max_model_len}]}


def _add_completion_routes(app: FastAPI, gateway: Gateway) -> None:
    async def completion(kind: str, request: Request, native: bool = False) -> Response:
        caller = await gateway.auth.caller(request)
        body = await read_json(request)
        # a client that leaves while its request waits for room gives the room (and its reservation) back
        relay = await until_disconnect(request, gateway.admit(kind, body, caller, native))
        headers = relay_headers(gateway, relay)
        if isinstance(relay.format, CollectFormat):
            return JSONResponse(await until_disconnect(request, gateway.complete(relay, kind)), headers=headers)
        return gateway.sse(relay.request_id, 0, headers)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await completion("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completion("text", request)

    @app.post("/v1/generate")
    async def generate(request: Request) -> Response:
        """The native stream of the design: `{"delta", "index"}` events, then `event: done` with usage."""
        return await completion("chat", request, native=True)


def relay_headers(gateway: Gateway, relay: Relay) -> dict[str, str]:
    """x-request-id, the rate-limit headers of the reservation, and the token that lets a browser's EventSource
    (which cannot send an Authorization header) resume this one stream."""
    headers = {"x-request-id": relay.request_id, "x-resume-token": gateway.resume_token(relay.request_id,
                                                                                         relay.owner)}
    return {**(relay.rate_limit_headers or {}), **headers}


def _add_stream_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.get("/v1/requests/{request_id}/stream")
    async def resume(request_id: str, request: Request) -> Response:
        last = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or "0"
        if not last.isdigit():
            raise bad_request("Last-Event-ID must be the integer id of an event", param="Last-Event-ID")
        await gateway.resumable(request_id, request)
        gateway.metrics.resumes.inc()
        return gateway.sse(request_id, int(last))

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel(request_id: str, request: Request) -> dict:
        caller = await gateway.auth.caller(request)
        return {"id": request_id, "object": "request.cancel", "cancelled": gateway.cancel(request_id, caller)}
