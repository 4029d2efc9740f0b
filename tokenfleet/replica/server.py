"""The replica's HTTP server: an OpenAI-compatible API around one AsyncEngine, plus /health, /metrics and /load."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace

from tokenfleet import tracing
from tokenfleet.api.chat_plan import ChatPlan, plan_chat
from tokenfleet.api.errors import bad_request, not_found
from tokenfleet.api.http import install_error_handler, read_json, until_disconnect, within_lifespan
from tokenfleet.api.protocol import ChatCompletionRequest, CompletionRequest, parse, prompt_token_ids_off_loop
from tokenfleet.api.render import Renderer
from tokenfleet.api.sse import SSE_HEADERS, sse_event
from tokenfleet.api.tools import tools_error
from tokenfleet.api.unsupported import reject_unsupported
from tokenfleet.engine.async_engine import AsyncEngine
from tokenfleet.engine.structured import GrammarError
from tokenfleet.logs import REQUEST_ID, valid_request_id
from tokenfleet.replica.choices import ChoiceStream
from tokenfleet.replica.disagg import (
    PREFILL_ONLY,
    KVRole,
    KVTransferCollector,
    PrefillService,
    attach_receiver,
    transfer_answer,
)
from tokenfleet.replica.metrics import ReplicaMetrics

log = logging.getLogger(__name__)
TRACER = tracing.tracer("replica")


class ReplicaService:
    """Turns validated API requests into engine work and rendered responses."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name
        self.metrics = ReplicaMetrics(engine.state, model_name)

    async def open(
        self, kind: str, body: object
    ) -> tuple[ChatCompletionRequest | CompletionRequest, ChoiceStream, Renderer]:
        """Validates a chat ("chat") or text ("text") completion body and starts its engine requests."""
        reject_unsupported(kind, body)
        if kind == "chat":
            req = parse(ChatCompletionRequest, body)
            self.check_model(req.model)
            prompts = await prompt_token_ids_off_loop(req, self.engine.tokenizer)
            plan = plan_chat(req, self.engine.tokenizer, prompts[0])
            stream, renderer = self.start(
                "chat", prompts, req, req.requested_max_tokens(), req.requested_logprobs(), plan
            )
            return req, stream, renderer
        req = parse(CompletionRequest, body)
        self.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        prompts = await prompt_token_ids_off_loop(req, self.engine.tokenizer)
        stream, renderer = self.start("text", prompts, req, req.max_tokens, req.logprobs)
        return req, stream, renderer

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise not_found(
                f"The model `{model}` does not exist; this replica serves `{self.model_name}`",
                param="model",
                code="model_not_found",
            )

    def start(
        self,
        kind: str,
        prompts: list[list[int]],
        req,
        max_tokens: int | None,
        logprobs: int | None,
        plan: ChatPlan | None = None,
    ) -> tuple[ChoiceStream, Renderer]:
        """Validates every prompt against the engine's limits, then starts the engine requests."""
        plan = plan or ChatPlan()
        params = plan.sampling(req.sampling_params(max_tokens, logprobs))
        for prompt in prompts:
            try:
                self.engine.validate(prompt, params)
            except GrammarError as e:
                raise (tools_error(e) if plan.grammar is not None else req.structured_output_error(e)) from e
            except ValueError as e:
                raise bad_request(str(e), param="messages" if kind == "chat" else "prompt") from e
        # the gateway's id when it sent one (x-request-id): one id for the request from the gateway to the engine
        request_id = REQUEST_ID.get() or f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        REQUEST_ID.set(request_id)
        stream = ChoiceStream(self.engine, request_id, prompts, params, req.n, req.priority)
        stream.trace_parent = tracing.parent()
        log.info(
            "request started: %d prompt(s) of %s tokens, n=%d, max_tokens=%s, priority %d",
            len(prompts),
            "/".join(str(len(p)) for p in prompts[:4]) + ("/..." if len(prompts) > 4 else ""),
            req.n,
            max_tokens,
            req.priority,
        )
        renderer = Renderer(
            kind, request_id, req.model, self.engine.tokenizer, token_ids=req.return_token_ids, plan=plan
        )
        return stream, renderer

    async def chunks(
        self, stream: ChoiceStream, renderer: Renderer, include_usage: bool, continuous_usage: bool = False
    ) -> AsyncIterator[dict]:
        """The OpenAI chunk objects of a streamed response (without the closing [DONE])."""
        arrival, started = time.monotonic(), set()
        try:
            async for index, out in stream:
                chunk = renderer.chunk(index, out, first=index not in started)
                stream.usage.reasoning_tokens = renderer.reasoning_tokens
                if continuous_usage:
                    chunk["usage"] = stream.usage.as_dict()
                yield chunk
                started.add(index)
            if include_usage:
                yield renderer.usage_chunk(stream.usage)
        finally:
            self._observe(stream, arrival)

    async def events(
        self, stream: ChoiceStream, renderer: Renderer, include_usage: bool, continuous_usage: bool = False
    ) -> AsyncIterator[str]:
        async for chunk in self.chunks(stream, renderer, include_usage, continuous_usage):
            yield sse_event(json.dumps(chunk))
        yield sse_event("[DONE]")

    async def respond(self, stream: ChoiceStream, renderer: Renderer) -> dict:
        arrival = time.monotonic()
        try:
            async for index, out in stream:
                if renderer.kind == "chat":
                    renderer.follow(index, out)  # the message is parsed as it arrives, exactly as when streamed
            stream.usage.reasoning_tokens = renderer.reasoning_tokens
        finally:
            self._observe(stream, arrival)
        return renderer.response([stream.finals[i] for i in range(stream.num_choices)], stream.usage)

    def _observe(self, stream: ChoiceStream, arrival: float) -> None:
        gaps = stream.gaps  # the whole stream's: observed once, not once per choice (n x the work, n x the count)
        for final in stream.finals.values():
            self.metrics.observe_request(
                arrival,
                stream.first_token_at,
                time.monotonic(),
                gaps,
                len(final.prompt_token_ids),
                len(final.token_ids),
                final.finish_reason,
            )
            gaps = []
        self.metrics.observe_engine_wait(stream.engine_timing, stream.first_token_at)
        _trace(stream, arrival)
        aborted = stream.num_choices - len(stream.finals)
        for _ in range(aborted):  # the client left: those choices were aborted
            self.metrics.finished.labels(**self.metrics.labels, finished_reason="abort").inc()
        log.info(
            "request finished: %d prompt + %d generated tokens (%d cached) in %.3f s, %s",
            stream.usage.prompt_tokens,
            stream.usage.completion_tokens,
            stream.usage.cached_tokens,
            time.monotonic() - arrival,
            f"{aborted} choice(s) aborted"
            if aborted
            else ",".join(sorted({f.finish_reason or "?" for f in stream.finals.values()})),
        )


def create_app(engine: AsyncEngine, model_name: str, role: KVRole | None = None) -> FastAPI:
    service = ReplicaService(engine, model_name)
    app = FastAPI(title="tokenfleet replica", docs_url=None, redoc_url=None)
    app.state.service = service
    role = role or KVRole()
    app.state.role = role

    install_error_handler(app)
    add_disaggregation(app, engine, model_name, role, service)

    @app.get("/health")
    async def health() -> Response:
        dead = getattr(engine, "dead", None)  # an engine process that exited: take this replica out of rotation
        if dead:
            return JSONResponse({"status": "engine down", "detail": dead}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/load")
    async def load() -> dict:
        return engine.state().load

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "tokenfleet",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        follow_caller(request)
        req, stream, renderer = await service.open("chat", await read_json(request))
        return await reply(request, service, stream, renderer, req)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        follow_caller(request)
        req, stream, renderer = await service.open("text", await read_json(request))
        return await reply(request, service, stream, renderer, req)

    return app


def add_disaggregation(
    app: FastAPI, engine: AsyncEngine, model_name: str, role: KVRole, service: ReplicaService
) -> None:
    """The prefill side's POST /internal/kv/prefill and the decode side's GET /internal/kv/info (replica/disagg.py)."""
    prefill = PrefillService(engine) if role.prefills and engine.kv_layout is not None else None
    if prefill is not None:
        within_lifespan(app, prefill.serving)
    receiver = attach_receiver(app, role, engine) if role.receives else None
    service.metrics.registry.register(KVTransferCollector(model_name, prefill, receiver))

    @app.get("/internal/kv/info")
    async def kv_info() -> dict:
        """This replica's KV layout (what a peer's blocks must match) and, on a decode replica, where it takes them."""
        layout = engine.kv_layout
        if layout is None:
            raise bad_request(f"KV blocks cannot move here: {engine.kv_transfer_refusal}", code="kv_transfer_refused")
        address = app.state.kv_address if receiver is not None else None
        return {"role": role.role, "address": address, "layout": layout.to_json()}

    @app.post("/internal/kv/prefill")
    async def kv_prefill(request: Request) -> dict:
        follow_caller(request)
        if prefill is None:
            raise bad_request(
                f"this replica does not prefill for others (role {role.role})", code="not_a_prefill_replica"
            )
        body = await read_json(request)
        token_ids, peer = (
            body.get("prompt") if isinstance(body, dict) else None,
            body.get("peer") if isinstance(body, dict) else None,
        )
        if not isinstance(peer, str) or not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids):
            raise bad_request("a prefill names `prompt` (token ids) and `peer` (the decode replica's URL)")
        try:
            engine.validate(token_ids, PREFILL_ONLY)
        except ValueError as e:
            raise bad_request(str(e), param="prompt") from e
        started = time.monotonic()
        stats = await prefill.prefill(token_ids, peer, REQUEST_ID.get())
        log.info(
            "prefilled %d tokens for %s: %d blocks sent, %d held there already",
            len(token_ids),
            peer,
            stats.blocks_sent,
            stats.blocks_skipped,
        )
        return transfer_answer(stats, started)


def follow_caller(request: Request) -> None:
    """The gateway's request id (x-request-id) and trace (traceparent), for this request's logs and spans."""
    REQUEST_ID.set(valid_request_id(request.headers.get("x-request-id")))
    tracing.continue_from_headers(request.headers)


def _trace(stream: ChoiceStream, arrival: float) -> None:
    """The request's spans, written once it is over: the whole request, the wait in the engine's queue, its prefill
    (to the first token, with its number of chunks) and its decode; under the gateway's routing attempt when the
    gateway sent its trace."""
    epoch = tracing.EpochClock()  # one clock reading for all: the stages meet exactly
    start = epoch(arrival)
    span = TRACER.start_span(
        "replica.request",
        stream.trace_parent,
        kind=trace.SpanKind.SERVER,
        start_time=start,
        attributes={
            "tokenfleet.request_id": stream.request_id,
            "gen_ai.usage.input_tokens": stream.usage.prompt_tokens,
        },
    )
    if not span.is_recording():
        return
    span.set_attribute("gen_ai.usage.output_tokens", stream.usage.completion_tokens)
    if stream.first_token_at is not None:
        first, inside, timing = epoch(stream.first_token_at), trace.set_span_in_context(span), stream.engine_timing
        prefill_start = start
        if timing is not None and timing.scheduled_time is not None:
            prefill_start = epoch(max(timing.scheduled_time, arrival))
            TRACER.start_span("engine_queue", inside, start_time=start).end(end_time=prefill_start)
        prefill = TRACER.start_span("prefill", inside, start_time=prefill_start)
        if timing is not None:
            prefill.set_attribute("tokenfleet.prefill_chunks", timing.num_prefill_chunks)
        prefill.end(end_time=first)
        TRACER.start_span("decode", inside, start_time=first).end(end_time=epoch.now_ns)
    span.end(end_time=epoch.now_ns)


async def reply(
    request: Request,
    service: ReplicaService,
    stream: ChoiceStream,
    renderer: Renderer,
    req: ChatCompletionRequest | CompletionRequest,
) -> Response:
    if req.stream:
        events = service.events(stream, renderer, req.include_usage, req.continuous_usage)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={**SSE_HEADERS, "x-request-id": renderer.request_id}
        )
    body = await until_disconnect(request, service.respond(stream, renderer))
    return JSONResponse(body, headers={"x-request-id": renderer.request_id})
