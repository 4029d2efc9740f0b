"""The gateway's work for one request, from admission to its usage record: prepared (preparation.py), admitted
(overload ladder, quota, fair queue, safety hook), routed to a replica and relayed into the resume buffer, then
reconciled and metered however it ends. Readers follow, resume and cancel it through the read side (streams.py);
the HTTP routes around it all are in app.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from opentelemetry import trace

from tokenfleet.api.errors import APIError, bad_request
from tokenfleet.dispatch.overload import Plan
from tokenfleet.gateway.admission import Admission, Admitted
from tokenfleet.gateway.ahead import Ahead
from tokenfleet.gateway.auth import Authenticator, Caller
from tokenfleet.gateway.budget import BudgetGuard, within_budget
from tokenfleet.gateway.chunks import Piece
from tokenfleet.gateway.formats import CollectFormat, EventFormat, NativeFormat, OpenAIFormat
from tokenfleet.gateway.metrics import GatewayMetrics
from tokenfleet.gateway.preparation import Body, ModelInfo, Prepared, RequestPreparation
from tokenfleet.gateway.relay import Relay
from tokenfleet.gateway.resume import ResumeBuffer
from tokenfleet.gateway.routing import RoutedRequest, routed_chunks
from tokenfleet.gateway.safety import SafetyHook, allow_all
from tokenfleet.gateway.settings import StreamSettings
from tokenfleet.gateway.streams import Streams
from tokenfleet.gateway.usage import usage_event
from tokenfleet.logs import REQUEST_ID
from tokenfleet.metering.recorder import UsageRecorder
from tokenfleet.router.pool import Route
from tokenfleet.router.router import Router
from tokenfleet.store.db import Database
from tokenfleet.tracing import epoch_ns, recording, tracer

__all__ = ["Gateway", "ModelInfo", "Prepared"]
log = logging.getLogger(__name__)
TRACER = tracer("gateway")
# a request that waited longer than this for room has its stream opened again (its early open may have expired):
# far below any resume buffer's TTL (300 s by default)
REOPEN_AFTER_S = 1.0


class Gateway:
    """The admit -> relay lifecycle, with the request preparation and the read side it shares its relays with."""

    def __init__(
        self,
        models: dict[str, ModelInfo],
        router: Router,
        buffer: ResumeBuffer,
        admission: Admission,
        auth: Authenticator,
        settings: StreamSettings | None = None,
        safety: SafetyHook = allow_all,
        resume_secret: bytes | None = None,
        usage: UsageRecorder | None = None,
        db: Database | None = None,
    ) -> None:
        """`usage`: metering (a usage event per admitted request), none for a library use without a database;
        `db`: the tenants' database (tenants, usage, conversations)."""
        self.models, self.router, self.buffer = models, router, buffer
        self.admission, self.auth = admission, auth
        self.settings, self.safety = settings or StreamSettings(), safety
        self.usage, self.db = usage, db
        self.relays: dict[str, Relay] = {}
        self.metrics = GatewayMetrics(lambda: sum(not r.finished.is_set() for r in self.relays.values()), admission)
        self.preparation = RequestPreparation(models, router)
        self.streams = Streams(
            self.relays, buffer, self.settings, self.metrics, resume_secret or secrets.token_bytes(32)
        )
        self.extra_metrics: Callable[[], bytes] | None = None  # e.g. the in-process replica's, when embedded
        self._background: set[asyncio.Task] = set()
        self.services: list[Callable[[], Awaitable[None]]] = []  # background loops, run while the app serves
        self.closers: list[Callable[[], Awaitable[None]]] = []  # called once at shutdown

    # --- admission --------------------------------------------------------------------------------------------

    async def admit(
        self,
        kind: str,
        body: object,
        caller: Caller,
        native: bool = False,
        affinity: str | None = None,
        mode: str | None = None,
        event_format: Callable[[str], EventFormat] | None = None,
    ) -> Relay:
        """Validate, apply the overload plan, reserve quota, then wait for room (the safety check runs meanwhile)
        and start generating. Anything that fails after the reservation gives it back. `event_format(request_id)`:
        how the relay writes its events, when not as the request's own API does (the Responses API's)."""
        p = await self.preparation.prepare(kind, body, caller, mode)
        REQUEST_ID.set(p.request_id)  # in this task's log lines, and sent on to the replica (x-request-id)
        arrived_ns = epoch_ns(p.arrived) if recording() else 0
        span = _start_span(
            "gateway.request",
            None,
            kind=trace.SpanKind.SERVER,
            start_time=arrived_ns,
            attributes={"tokenfleet.request_id": p.request_id, "tokenfleet.tier": caller.principal.tier},
        )
        try:
            return await self._admit(p, caller, native, affinity, (span, arrived_ns), event_format)
        except BaseException as e:
            _end_span(span, e)
            raise

    async def _admit(
        self,
        p: Prepared,
        caller: Caller,
        native: bool,
        affinity: str | None,
        traced: tuple[trace.Span, int],
        event_format: Callable[[str], EventFormat] | None,
    ) -> Relay:
        span, arrived_ns = traced  # the request's span, and when it arrived (the admission span's start too)
        admission = _start_span("admission", span, start_time=arrived_ns)
        opening: asyncio.Future | None = None
        ahead: Ahead | None = None
        try:
            tokens = await self._plan(p, caller)
            fmt = event_format(p.request_id) if event_format else _event_format(p.request_id, p.req, native)
            ahead = self._ask_ahead(p, caller, tokens, affinity, span)
            # the stream's open in the buffer does not depend on the quota's answer: its round trip overlaps the
            # reservation's (a refused request's stream is discarded; nothing has reached a replica)
            opening = asyncio.ensure_future(self.buffer.open(p.request_id, caller.tenant, fmt.kind))
            opened_at = time.monotonic()
            if ahead is not None:  # the replica asked before the reservation is made (the upstream's time overlaps it)
                await asyncio.sleep(0)
            admitted = await self.admission.reserve_for(p.request_id, caller, tokens)
        except BaseException as e:
            _end_span(admission, e)
            if opening is not None:
                self._spawn(self._discard(opening, p.request_id))
            if ahead is not None:
                self._spawn(ahead.cancel())
            raise
        admission.set_attribute("tokenfleet.reserved_tokens", tokens)
        admission.end()
        queued = asyncio.ensure_future(self.admission.queue(admitted, p.model))
        try:
            if ahead is not None:
                await asyncio.sleep(0)  # the queue's turn: a slot granted at once, as when the replica was asked
                if not queued.done():  # the pool filled up meanwhile: the replica is asked again once in it
                    self._spawn(ahead.cancel())
                    ahead = None
            with _current(_start_span("queue_wait", span)):
                refusal = await self.safety(p.body, p.prompts[0])
                if refusal:
                    raise bad_request(refusal, code="content_filter")
                await queued
            early = opening if time.monotonic() - opened_at < REOPEN_AFTER_S else None  # None: the relay opens it
            return await self.start_relay(p, fmt, admitted, affinity, span, early, ahead)
        except BaseException as e:
            queued.cancel()
            if ahead is not None and p.request_id not in self.relays:
                self._spawn(ahead.cancel())
            self._spawn(self._give_back(queued, admitted))
            if p.request_id not in self.relays:  # no relay took the stream's open over
                self._spawn(self._discard(opening, p.request_id))
            if self.usage is not None and p.request_id not in self.relays:  # it never ran: no tokens, no route
                status = "cancelled" if isinstance(e, asyncio.CancelledError) else "failed"
                self.usage.finished(usage_event(p.request_id, p.model, caller, p.arrived, None, status))
            raise

    async def _plan(self, p: Prepared, caller: Caller) -> int:
        """The overload plan (which may move the request to another model or cap its output); the tokens to reserve."""
        plan = self.admission.plan_for(caller)
        if plan.model_override is not None:
            await self.preparation.reroute(p, plan.model_override, f"overload:{plan.level}")
        if not self.router.pools_for(p.model).can_serve():  # refuse now rather than queue forever
            raise APIError(
                503,
                f"no replica of {p.resolution.model.name} is taking requests right now; retry shortly",
                "service_unavailable",
                code="no_replica",
                headers={"retry-after": "1"},
            )
        p.body = _apply_plan(p.body, p.max_tokens, plan, caller.tier.priority)
        limit = p.max_tokens if plan.max_tokens_cap is None else p.body["max_tokens"]
        return self.admission.tokens_for(caller, p.prompt_tokens, p.choices, limit)

    async def _give_back(self, queued: asyncio.Future, admitted: Admitted) -> None:
        await asyncio.gather(queued, return_exceptions=True)
        await self.admission.finish(admitted, None)

    async def _discard(self, opening: asyncio.Future, request_id: str) -> None:
        """The stream opened for a request that never started: once its open has landed, it goes."""
        await asyncio.gather(opening, return_exceptions=True)
        await self.buffer.discard(request_id)

    # --- relaying ---------------------------------------------------------------------------------------------

    def _ask_ahead(
        self, p: Prepared, caller: Caller, tokens: int, affinity: str | None, span: trace.Span
    ) -> Ahead | None:
        """The replica asked now, while the quota decides, when the admission allows it (Admission.may_ask_ahead)
        and no safety hook has to see the prompt first."""
        if self.safety is not allow_all or not self.admission.may_ask_ahead(caller, tokens, p.model):
            return None
        route, relay_span, chunks = self._routed(p, affinity, span)
        return Ahead(chunks, route, relay_span)

    def _routed(
        self, p: Prepared, affinity: str | None, span: trace.Span
    ) -> tuple[Route, trace.Span, AsyncIterator[Piece]]:
        """The request's stream from the replicas the router picks (with failover), and the relay's span."""
        model = p.resolution.model.name
        span.set_attribute("gen_ai.request.model", model)
        relay_span = _start_span("relay", span)
        route = Route(model, "", "", "", 0, rule=p.resolution.rule)
        routed = RoutedRequest(
            self.router.pools_for(model),
            p.kind,
            p.body,
            p.prompts[0],
            self.models[model].tokenizer,
            route,
            affinity,
            self.router.settings.max_retries,
            p.choices,
            trace=relay_span,
        )
        return route, relay_span, routed_chunks(routed)

    async def start_relay(
        self,
        p: Prepared,
        fmt: EventFormat,
        admitted: Admitted | None = None,
        affinity: str | None = None,
        span: trace.Span | None = None,
        opening: asyncio.Future | None = None,
        ahead: Ahead | None = None,
    ) -> Relay:
        """`span`: the request's own (ended with it); the relay's span and each routing attempt's go under it.
        `opening`: the stream's open in the buffer, when already under way. `ahead`: the replica, already asked."""
        model = p.resolution.model.name
        span = span or _start_span("gateway.request", None, start_time=epoch_ns(p.arrived))
        if ahead is not None:
            route, relay_span, chunks = ahead.route, ahead.span, ahead.chunks()
        else:
            route, relay_span, chunks = self._routed(p, affinity, span)
        relay = Relay(
            p.request_id,
            self.buffer,
            fmt,
            self.settings.disconnect_grace_s,
            owner=admitted.caller.tenant if admitted else "",
            rate_limit_headers=admitted.headers if admitted else None,
        )
        relay.route = route
        if admitted is not None:
            chunks = within_budget(chunks, BudgetGuard(self.admission, admitted), p.choices)
        await relay.start(chunks, opening)  # registered only once it runs: a relay that never started
        self.relays[relay.request_id] = relay  # is metered by admit and never counted as active
        if self.usage is not None and admitted is not None:
            caller, prompt_tokens = admitted.caller, sum(map(len, p.prompts))  # billed from the open row on
            self.usage.started(
                p.request_id,
                lambda: usage_event(p.request_id, model, caller, p.arrived, relay, prompt_tokens=prompt_tokens),
            )
        relay.task.add_done_callback(lambda _: self._relay_done(relay, admitted, p, (relay_span, span)))
        self._maybe_shadow(p, route)
        return relay

    def _relay_done(self, relay: Relay, admitted: Admitted | None, p: Prepared, spans: tuple[trace.Span, ...]) -> None:
        if relay.cancel_reason:
            self.metrics.cancels.labels(relay.cancel_reason).inc()
        _end_relay_spans(relay, spans)
        if admitted is not None:
            self._spawn(self.admission.finish(admitted, relay.usage, p.choices))
            if self.usage is not None:
                self.usage.finished(
                    usage_event(p.request_id, p.resolution.model.name, admitted.caller, p.arrived, relay)
                )
        loop = asyncio.get_running_loop()
        loop.call_later(self.settings.disconnect_grace_s + 60, self._forget, relay.request_id)

    def _forget(self, request_id: str) -> None:
        self.relays.pop(request_id, None)
        self.buffer.release(request_id)

    def _maybe_shadow(self, p: Prepared, route: Route) -> None:
        candidate = self.router.shadow_for(route.model, p.request_id)
        if candidate is not None:
            self._spawn(self._shadow(p, candidate))

    async def _shadow(self, p: Prepared, candidate: str) -> None:
        """The same prompt on the candidate model; its output is thrown away, its latency recorded."""
        pools = self.router.pools_for(candidate)
        started, first = time.monotonic(), None
        try:
            replica, _ = pools.choose(p.prompts[0])
            pools.started(replica)
            try:
                async for _ in replica.upstream.stream(p.kind, {**p.body, "model": candidate}):
                    first = first or time.monotonic() - started
            finally:
                pools.finished(replica, None, first)
            self.metrics.shadow_latency.labels(candidate, "ttft").observe(first or 0.0)
            self.metrics.shadow_latency.labels(candidate, "e2e").observe(time.monotonic() - started)
        except Exception as e:  # a shadow never affects the primary request
            log.info("shadow request to %s failed: %r", candidate, e)

    def _spawn(self, work) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def render_metrics(self) -> bytes:
        return self.metrics.render() + (self.extra_metrics() if self.extra_metrics else b"")


def _start_span(name: str, parent: trace.Span | None, **options) -> trace.Span:
    """A span under `parent` (None: a root), or, when it could be neither recorded nor passed on (no tracing set up),
    the invalid span itself: nothing built per request, and its children are skipped alike."""
    if not recording(parent):
        return trace.INVALID_SPAN
    return TRACER.start_span(name, None if parent is None else trace.set_span_in_context(parent), **options)


def _current(span: trace.Span):
    """The span as the current one while in the block (ended with it), or nothing to do for the invalid one."""
    return contextlib.nullcontext() if span is trace.INVALID_SPAN else trace.use_span(span, end_on_exit=True)


def _end_span(span: trace.Span, error: BaseException | None = None) -> None:
    if isinstance(error, APIError):
        span.set_attribute("http.response.status_code", error.status)
    if error is not None and not isinstance(error, asyncio.CancelledError):
        span.set_status(trace.StatusCode.ERROR, str(error)[:200])
    span.end()


def _end_relay_spans(relay: Relay, spans: tuple[trace.Span, ...]) -> None:
    for span in spans:
        if span is trace.INVALID_SPAN:
            continue
        span.set_attribute("tokenfleet.status", relay.status)
        if relay.usage is not None:
            span.set_attribute("gen_ai.usage.input_tokens", relay.usage.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", relay.usage.completion_tokens)
        if relay.failure:
            span.set_status(trace.StatusCode.ERROR, relay.failure[:200])
        span.end()


def _apply_plan(body: dict, requested: int | None, plan: Plan, priority: int) -> dict:
    """The body the replica gets: the tier's priority class (never the client's own), and under overload a
    smaller max_tokens for free users."""
    body = {**body, "priority": priority}
    cap = plan.max_tokens_cap
    if cap is not None:
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = cap if requested is None else min(requested, cap)
    return body


def _event_format(request_id: str, req: Body, native: bool) -> EventFormat:
    if native:
        return NativeFormat(request_id)
    if not req.stream:
        return CollectFormat(request_id)
    return OpenAIFormat(request_id, req.include_usage, req.continuous_usage)
