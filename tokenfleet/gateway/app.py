"""The public API: validation, token counting, the safety hook, relaying replica streams as SSE with ids and
heartbeats, resume with Last-Event-ID, and cancellation."""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenfleet.api.errors import bad_request, not_found
from tokenfleet.api.http import install_error_handler, read_json, until_disconnect
from tokenfleet.api.protocol import ChatCompletionRequest, CompletionRequest, parse, prompt_token_ids
from tokenfleet.api.sse import sse_event
from tokenfleet.config import StreamSettings
from tokenfleet.gateway.aggregate import aggregate
from tokenfleet.gateway.formats import NativeFormat, OpenAIFormat
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
    def __init__(self, model: ModelInfo, upstreams: list[Upstream], buffer: ResumeBuffer,
                 settings: StreamSettings | None = None, safety: SafetyHook = allow_all) -> None:
        if not upstreams:
            raise ValueError("the gateway needs at least one replica")
        self.model, self.upstreams, self.buffer = model, upstreams, buffer
        self.settings, self.safety = settings or StreamSettings(), safety
        self.relays: dict[str, Relay] = {}
        self.in_flight = {u.name: 0 for u in upstreams}
        self.metrics = GatewayMetrics(lambda: sum(not r.finished.is_set() for r in self.relays.values()))
        self.extra_metrics: Callable[[], bytes] | None = None  # e.g. the in-process replica's, when embedded

    # --- admission ----------------------------------------------------------------------------------------

    def count_prompt(self, kind: str, req: ChatCompletionRequest | CompletionRequest) -> list[list[int]]:
        """Tokenizes the prompt(s) before anything reaches a replica, and checks them against the context window."""
        if req.model != self.model.name:
            raise not_found(f"The model `{req.model}` does not exist", param="model", code="model_not_found")
        prompts = prompt_token_ids(req, self.model.tokenizer)
        if kind == "chat":
            max_tokens, param = req.requested_max_tokens(), "messages"
        else:
            max_tokens, param = req.max_tokens, "prompt"
        limit = self.model.max_model_len
        for prompt in prompts:
            if not prompt:
                raise bad_request("the prompt is empty", param=param)
            if len(prompt) + (max_tokens or 1) > limit:
                raise bad_request(f"This model's maximum context length is {limit} tokens; you requested "
                                  f"{len(prompt) + (max_tokens or 1)} tokens ({len(prompt)} in the prompt, "
                                  f"{max_tokens or 1} to generate)", param=param, code="context_length_exceeded")
        return prompts

    async def admit(self, kind: str, body: object) -> tuple[ChatCompletionRequest | CompletionRequest, Upstream]:
        req = parse(ChatCompletionRequest if kind == "chat" else CompletionRequest, body)
        prompts = self.count_prompt(kind, req)
        refusal, upstream = await asyncio.gather(self.safety(body, prompts[0]), self.choose_upstream())
        if refusal:
            raise bad_request(refusal, code="content_filter")
        return req, upstream

    async def choose_upstream(self) -> Upstream:
        """Least in-flight work first (the router issue replaces this with cache-aware, load-reported choice)."""
        return min(self.upstreams, key=lambda u: self.in_flight[u.name])

    # --- relaying -----------------------------------------------------------------------------------------

    async def start_relay(self, upstream: Upstream, kind: str, body: dict, include_usage: bool,
                          native: bool = False) -> Relay:
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        events = NativeFormat(request_id) if native else OpenAIFormat(request_id, include_usage)
        relay = Relay(request_id, self.buffer, events, self.settings.disconnect_grace_s)
        self.relays[request_id] = relay
        self.in_flight[upstream.name] += 1
        await relay.start(upstream.stream(kind, body))
        relay.task.add_done_callback(lambda _: self._relay_done(relay, upstream))
        return relay

    def _relay_done(self, relay: Relay, upstream: Upstream) -> None:
        self.in_flight[upstream.name] -= 1
        if relay.cancel_reason:
            self.metrics.cancels.labels(relay.cancel_reason).inc()
        loop = asyncio.get_running_loop()
        loop.call_later(self.settings.disconnect_grace_s + 60, self.relays.pop, relay.request_id, None)

    def sse(self, request_id: str, after: int) -> SSEResponse:
        relay = self.relays.get(request_id)
        if relay is not None:
            relay.reader_joined()

        def on_end(how: str) -> None:
            self.metrics.stream_endings.labels(how).inc()
            if relay is not None:
                relay.reader_left(disconnected=how == "disconnect")

        return SSEResponse(self._events(request_id, after, relay), {"x-request-id": request_id},
                           self.settings.ping_interval_s, self.settings.send_timeout_s, on_end)

    async def _events(self, request_id: str, after: int, relay: Relay | None):
        async for event in self.buffer.read(request_id, after):
            if relay is not None and relay.last_id - event.id > self.settings.max_lag_events:
                raise SlowClient(request_id)
            yield sse_event(event.data, event.id, event.event)

    async def complete(self, upstream: Upstream, kind: str, body: dict) -> dict:
        """A non-streamed request: generate, then answer with the whole response."""
        self.in_flight[upstream.name] += 1
        try:
            chunks = [chunk async for chunk in upstream.stream(kind, body)]
        finally:
            self.in_flight[upstream.name] -= 1
        response = aggregate(chunks, kind)
        response["id"] = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        return response

    def cancel(self, request_id: str) -> bool:
        relay = self.relays.get(request_id)
        if relay is None:
            raise not_found(f"no request {request_id!r} (finished requests are kept for a few minutes)",
                            param="request_id")
        return relay.cancel("api")

    def render_metrics(self) -> bytes:
        return self.metrics.render() + (self.extra_metrics() if self.extra_metrics else b"")


def create_gateway_app(gateway: Gateway, extra_routes: Callable[[FastAPI], None] | None = None) -> FastAPI:
    app = FastAPI(title="tokenfleet gateway", docs_url=None, redoc_url=None)
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
    async def completion(kind: str, request: Request) -> Response:
        body = await read_json(request)
        req, upstream = await gateway.admit(kind, body)
        if not req.stream:
            return JSONResponse(await until_disconnect(request, gateway.complete(upstream, kind, body)))
        relay = await gateway.start_relay(upstream, kind, body, req.include_usage)
        return gateway.sse(relay.request_id, 0)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await completion("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completion("text", request)

    @app.post("/v1/generate")
    async def generate(request: Request) -> Response:
        """The native stream of the design: `{"delta", "index"}` events, then `event: done` with usage."""
        body = await read_json(request)
        _, upstream = await gateway.admit("chat", body)
        relay = await gateway.start_relay(upstream, "chat", body, include_usage=True, native=True)
        return gateway.sse(relay.request_id, 0)


def _add_stream_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.get("/v1/requests/{request_id}/stream")
    async def resume(request_id: str, request: Request) -> Response:
        last = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or "0"
        if not last.isdigit():
            raise bad_request("Last-Event-ID must be the integer id of an event", param="Last-Event-ID")
        if not await gateway.buffer.exists(request_id):
            raise not_found(f"no stream {request_id!r} to resume (streams are kept for a few minutes)",
                            param="request_id")
        gateway.metrics.resumes.inc()
        return gateway.sse(request_id, int(last))

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel(request_id: str) -> dict:
        return {"id": request_id, "object": "request.cancel", "cancelled": gateway.cancel(request_id)}
