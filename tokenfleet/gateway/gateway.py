"""The gateway's work for one request: validate, resolve the model, count tokens, admit (overload ladder, quota,
fair queue, safety hook), route to a replica and relay its stream into the resume buffer; then resume, cancel and
reconcile. The HTTP routes around it are in app.py."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from starlette.requests import Request

from tokenfleet.api.errors import APIError, bad_request, not_found
from tokenfleet.api.protocol import ChatCompletionRequest, CompletionRequest, parse, prompt_token_ids_off_loop
from tokenfleet.dispatch.overload import Plan
from tokenfleet.gateway.admission import Admission, Admitted
from tokenfleet.gateway.aggregate import aggregate
from tokenfleet.gateway.auth import Authenticator, Caller
from tokenfleet.gateway.budget import BudgetGuard, within_budget
from tokenfleet.gateway.formats import CollectFormat, EventFormat, NativeFormat, OpenAIFormat
from tokenfleet.gateway.metrics import GatewayMetrics
from tokenfleet.gateway.relay import Relay
from tokenfleet.gateway.resume import ResumeBuffer
from tokenfleet.gateway.routing import RoutedRequest, routed_chunks
from tokenfleet.gateway.safety import SafetyHook, allow_all
from tokenfleet.gateway.settings import StreamSettings
from tokenfleet.gateway.sse_response import SSEResponse
from tokenfleet.gateway.usage import usage_event
from tokenfleet.metering.recorder import UsageRecorder
from tokenfleet.model.tokenizer import Tokenizer
from tokenfleet.router.catalog import RequestFacts, Resolution
from tokenfleet.router.pool import Route
from tokenfleet.router.router import Router
from tokenfleet.store.db import Database

log = logging.getLogger(__name__)
Body = ChatCompletionRequest | CompletionRequest


@dataclass
class ModelInfo:
    name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int | None = None  # the model's (its config's); token-id prompts are checked against it


@dataclass
class Prepared:
    """A request that passed validation: its model, its prompts as tokens, and the body a replica will get."""

    request_id: str
    kind: str
    req: Body
    body: dict
    resolution: Resolution
    prompts: list[list[int]]
    arrived: float = field(default_factory=time.monotonic)  # for the usage record's latency and TTFT

    @property
    def choices(self) -> int:
        return self.req.n * len(self.prompts)


class Gateway:
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
    ) -> None:
        self.models, self.router, self.buffer = models, router, buffer
        self.admission, self.auth = admission, auth
        self.settings, self.safety = settings or StreamSettings(), safety
        self.relays: dict[str, Relay] = {}
        self.metrics = GatewayMetrics(lambda: sum(not r.finished.is_set() for r in self.relays.values()), admission)
        self.extra_metrics: Callable[[], bytes] | None = None  # e.g. the in-process replica's, when embedded
        self._background: set[asyncio.Task] = set()
        self.resume_secret = resume_secret or secrets.token_bytes(32)
        self.services: list[Callable[[], Awaitable[None]]] = []  # background loops, run while the app serves
        self.closers: list[Callable[[], Awaitable[None]]] = []  # called once at shutdown
        self.usage: UsageRecorder | None = None  # metering: a usage event per admitted request
        self.db: Database | None = None  # tenants, usage, conversations

    # --- validation -------------------------------------------------------------------------------------------

    async def prepare(self, kind: str, body: object, caller: Caller, mode: str | None = None) -> Prepared:
        """Parses the body, resolves the model (aliases, product rules, canary), tokenizes the prompt(s) with that
        model's tokenizer before anything reaches a replica, and checks them against its context window."""
        req = parse(ChatCompletionRequest if kind == "chat" else CompletionRequest, body)
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        first = self._tokenizer_for(req.model)
        prompts = await prompt_token_ids_off_loop(req, first.tokenizer)
        facts = RequestFacts(len(prompts[0]), _has_attachments(body), mode or body.get("mode"))
        resolution = self.router.resolve(req.model, facts, caller.principal.tier, request_id)
        info = self.models[resolution.model.name]
        if info.tokenizer is not first.tokenizer:
            prompts = await prompt_token_ids_off_loop(req, info.tokenizer)
        self._check_window(kind, req, prompts, info)
        return Prepared(request_id, kind, req, {**body, "model": info.name}, resolution, prompts)

    def _tokenizer_for(self, requested: str) -> ModelInfo:
        """The named model's, or for a routing alias its first rule's (to count the tokens its rules look at)."""
        rules = self.router.catalog.router_aliases.get(requested)
        spec = self.router.catalog.lookup(rules[0].model if rules else requested)
        if spec is None:
            raise not_found(f"The model `{requested}` does not exist", param="model", code="model_not_found")
        return self.models[spec.name]

    async def _reroute(self, p: Prepared, model: str, why: str) -> None:
        """Moves a prepared request to another model (the overload ladder sends free users to the smaller one)."""
        spec = self.router.catalog.lookup(model)
        info = self.models[spec.name]
        if info.tokenizer is not self.models[p.resolution.model.name].tokenizer:
            p.prompts = await prompt_token_ids_off_loop(p.req, info.tokenizer)
        self._check_window(p.kind, p.req, p.prompts, info)
        p.resolution = Resolution(spec, p.resolution.requested, why, spec.deprecated_on)
        p.body = {**p.body, "model": spec.name}

    def _check_window(self, kind: str, req: Body, prompts: list[list[int]], info: ModelInfo) -> None:
        max_tokens, param = _max_tokens(kind, req), "messages" if kind == "chat" else "prompt"
        for prompt in prompts:
            if not prompt:
                raise bad_request("the prompt is empty", param=param)
            if info.vocab_size is not None and max(prompt) >= info.vocab_size:
                raise bad_request(
                    f"prompt token id {max(prompt)} is outside the vocabulary (0..{info.vocab_size - 1})", param=param
                )
            if len(prompt) + (max_tokens or 1) > info.max_model_len:
                raise bad_request(
                    f"This model's maximum context length is {info.max_model_len} tokens; you "
                    f"requested {len(prompt) + (max_tokens or 1)} tokens ({len(prompt)} in the "
                    f"prompt, {max_tokens or 1} to generate)",
                    param=param,
                    code="context_length_exceeded",
                )

    # --- admission --------------------------------------------------------------------------------------------

    async def admit(
        self,
        kind: str,
        body: object,
        caller: Caller,
        native: bool = False,
        affinity: str | None = None,
        mode: str | None = None,
    ) -> Relay:
        """Validate, apply the overload plan, reserve quota, then wait for room (the safety check runs meanwhile)
        and start generating. Anything that fails after the reservation gives it back."""
        p = await self.prepare(kind, body, caller, mode)
        plan = self.admission.plan(caller)
        if plan.model_override is not None:
            await self._reroute(p, plan.model_override, f"overload:{plan.level}")
        if not self.router.pools_for(p.resolution.model.name).can_serve():  # refuse now rather than queue forever
            raise APIError(
                503,
                f"no replica of {p.resolution.model.name} is taking requests right now; retry shortly",
                "service_unavailable",
                code="no_replica",
                headers={"retry-after": "1"},
            )
        p.body = _apply_plan(p.body, kind, p.req, plan, caller.tier.priority)
        limit = _max_tokens(kind, p.req) if plan.max_tokens_cap is None else p.body["max_tokens"]
        tokens = self.admission.expected_tokens(caller, sum(map(len, p.prompts)), p.choices, limit)
        admitted = await self.admission.reserve(p.request_id, caller, tokens)
        queued = asyncio.ensure_future(self.admission.queue(admitted, tokens, p.resolution.model.name))
        try:
            refusal = await self.safety(p.body, p.prompts[0])
            if refusal:
                raise bad_request(refusal, code="content_filter")
            await queued
            return await self.start_relay(p, _event_format(p.request_id, p.req, native), admitted, affinity)
        except BaseException as e:
            queued.cancel()
            self._spawn(self._give_back(queued, admitted))
            if self.usage is not None and p.request_id not in self.relays:  # it never ran: no tokens, no route
                status = "cancelled" if isinstance(e, asyncio.CancelledError) else "failed"
                self.usage.finished(usage_event(p.request_id, p.resolution.model.name, caller, p.arrived, None, status))
            raise

    async def _give_back(self, queued: asyncio.Future, admitted: Admitted) -> None:
        await asyncio.gather(queued, return_exceptions=True)
        await self.admission.leave(admitted, None)

    # --- relaying ---------------------------------------------------------------------------------------------

    async def start_relay(
        self, p: Prepared, fmt: EventFormat, admitted: Admitted | None = None, affinity: str | None = None
    ) -> Relay:
        model = p.resolution.model.name
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
        )
        relay = Relay(
            p.request_id,
            self.buffer,
            fmt,
            self.settings.disconnect_grace_s,
            owner=admitted.caller.tenant if admitted else "",
            rate_limit_headers=admitted.headers if admitted else None,
        )
        relay.route = route
        chunks = routed_chunks(routed)
        if admitted is not None:
            chunks = within_budget(chunks, BudgetGuard(self.admission, admitted), p.choices)
        await relay.start(chunks)  # registered only once it runs: a relay that never started
        self.relays[relay.request_id] = relay  # is metered by admit and never counted as active
        if self.usage is not None and admitted is not None:
            caller, prompt_tokens = admitted.caller, sum(map(len, p.prompts))  # billed from the open row on
            self.usage.started(
                p.request_id,
                lambda: usage_event(p.request_id, model, caller, p.arrived, relay, prompt_tokens=prompt_tokens),
            )
        relay.task.add_done_callback(lambda _: self._relay_done(relay, admitted, p))
        self._maybe_shadow(p, route)
        return relay

    def _relay_done(self, relay: Relay, admitted: Admitted | None, p: Prepared) -> None:
        if relay.cancel_reason:
            self.metrics.cancels.labels(relay.cancel_reason).inc()
        if admitted is not None:
            self._spawn(self.admission.leave(admitted, relay.usage, p.choices))
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

    # --- reading, resuming, cancelling ------------------------------------------------------------------------

    def sse(self, request_id: str, after: int, headers: dict[str, str] | None = None) -> SSEResponse:
        relay = self.relays.get(request_id)
        behind = None
        if relay is not None:
            relay.reader_joined()
            limit = self.settings.max_lag_events
            behind = lambda event_id: relay.last_id - event_id > limit  # noqa: E731

        def on_end(how: str) -> None:
            self.metrics.stream_endings.labels(how).inc()
            if relay is not None:
                relay.reader_left(disconnected=how == "disconnect")

        return SSEResponse(
            self.buffer.follow(request_id, after),
            {**(headers or {}), "x-request-id": request_id},
            self.settings.ping_interval_s,
            self.settings.send_timeout_s,
            on_end,
            behind,
        )

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
            # compare_digest refuses non-ASCII text with a TypeError; no token of ours has any
            allowed = token.isascii() and hmac.compare_digest(token, self.resume_token(request_id, owner))
        else:
            allowed = owner is not None and owner == tenant
        if not allowed:
            raise not_found(
                f"no stream {request_id!r} to resume (streams are kept for a few minutes)", param="request_id"
            )

    def cancel(self, request_id: str, caller: Caller) -> bool:
        relay = self.relays.get(request_id)
        if relay is None or relay.owner != caller.tenant:
            raise not_found(
                f"no request {request_id!r} (finished requests are kept for a few minutes)", param="request_id"
            )
        return relay.cancel("api")

    def render_metrics(self) -> bytes:
        return self.metrics.render() + (self.extra_metrics() if self.extra_metrics else b"")


def _max_tokens(kind: str, req: Body) -> int | None:
    return req.requested_max_tokens() if kind == "chat" else req.max_tokens


def _has_attachments(body: dict) -> bool:
    return any(
        isinstance(m, dict)
        and isinstance(m.get("content"), list)
        and any(isinstance(part, dict) and part.get("type") != "text" for part in m["content"])
        for m in body.get("messages") or []
    )


def _apply_plan(body: dict, kind: str, req: Body, plan: Plan, priority: int) -> dict:
    """The body the replica gets: the tier's priority class (never the client's own), and under overload a
    smaller max_tokens for free users."""
    body = {**body, "priority": priority}
    cap = plan.max_tokens_cap
    if cap is not None:
        requested = _max_tokens(kind, req)
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = cap if requested is None else min(requested, cap)
    return body


def _event_format(request_id: str, req: Body, native: bool) -> EventFormat:
    if native:
        return NativeFormat(request_id)
    if not req.stream:
        return CollectFormat(request_id)
    return OpenAIFormat(request_id, req.include_usage, req.continuous_usage)
