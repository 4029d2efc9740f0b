"""Admission of one request at the gateway, in the order the design fixes (the rules live in dispatch/admission.py,
shared with the simulator): the overload ladder (shed before any GPU time), the token quota (reserve input +
expected output), then the dispatcher's fair queue (wait for room in the pool). When the request ends, however it
ends, the reservation is reconciled with what it used and its slot is freed."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from tokenfleet.api.errors import APIError, rate_limited, unavailable
from tokenfleet.api.usage import Usage
from tokenfleet.dispatch.admission import AdmissionCore, OverQuota, Shed
from tokenfleet.dispatch.overload import OverloadLadder, Plan
from tokenfleet.dispatch.queue import Dispatcher
from tokenfleet.dispatch.tickets import Slot, Ticket
from tokenfleet.gateway.auth import Caller
from tokenfleet.quota.base import Decision, QuotaService, QuotaStoreError, QuotaUnavailable, Reservation

log = logging.getLogger(__name__)
# Asking a replica ahead of the quota's answer (Admission.may_ask_ahead): the last admitted request of a caller says
# how much room it had for this long; a tenant refused within one per-minute window is always checked first.
ROOM_FRESH_S = 10.0
REFUSED_COOL_DOWN_S = 60.0
_MAX_CALLERS = 100_000  # the room records kept; beyond, they are dropped (and rebuilt by the next decisions)


@dataclass
class Admitted:
    request_id: str
    caller: Caller
    reservation: Reservation
    model: str = ""  # whose dispatch queue it waits in
    slot: Slot | None = None
    headers: Mapping[str, str] | None = None  # x-ratelimit-* for the response
    ticket: Ticket | None = None


@dataclass(frozen=True)
class _Room:
    """What a caller's tightest per-minute buckets held after its last admitted request (inf: no such limit)."""

    at: float
    requests: float
    tokens: float


class Admission(AdmissionCore):
    """The admission core (dispatch/admission.py) for a gateway: its refusals as OpenAI's errors, the wait for a
    slot as an asyncio future, and a quota store that cannot answer never failing a request that already runs."""

    def __init__(
        self, quota: QuotaService, dispatchers: dict[str, Dispatcher], ladder: OverloadLadder, ask_ahead: bool = False
    ) -> None:
        super().__init__(quota, dispatchers, ladder)
        self.quota: QuotaService = quota
        self.ask_ahead = ask_ahead
        self._room: dict[str, _Room] = {}  # a caller's user scope -> what its last admitted request left
        self._refused: dict[str, float] = {}  # tenant -> when the quota last refused it (or could not answer)

    def may_ask_ahead(self, caller: Caller, tokens: int, model: str) -> bool:
        """Whether this request's replica may be asked while the quota's answer is on its way: the caller's last
        admitted request, moments ago, left room for two more of this size; its tenant was not refused within a
        minute; and the request gets its slot in the pool at once. A refused request's replica is stopped before
        anything reaches the client; what it costs is the start of one prefill."""
        if not self.ask_ahead:
            return False
        now = time.monotonic()
        if now - self._refused.get(caller.tenant, -math.inf) < REFUSED_COOL_DOWN_S:
            return False
        room = self._room.get(caller.scopes()[1].name)
        if room is None or now - room.at > ROOM_FRESH_S or room.requests < 2 or room.tokens < 2 * tokens:
            return False
        dispatcher = self.dispatchers.get(model)
        return dispatcher is not None and dispatcher.grants_at_once(caller.principal.tier)

    def plan_for(self, caller: Caller) -> Plan:
        """The overload ladder's verdict for a new request of this tier; a shed request never costs GPU time."""
        try:
            return self.plan(caller.principal.tier)
        except Shed as shed:
            log.info(
                "shed a %s request of %s (overload level %d)", caller.principal.tier, caller.tenant, shed.plan.level
            )
            retry = shed.plan.retry_after_s or 1.0
            raise rate_limited(
                f"The service is under high demand; free-tier requests are paused. Please retry in {retry:.0f}s.",
                {"retry-after": str(math.ceil(retry)), "retry-after-ms": str(int(retry * 1000))},
                code="high_demand",
            ) from None

    def tokens_for(self, caller: Caller, prompt_tokens: int, choices: int, max_tokens: int | None) -> int:
        return self.expected_tokens(
            caller.tenant, caller.tier.typical_output_tokens, prompt_tokens, choices, max_tokens
        )

    async def reserve_for(self, request_id: str, caller: Caller, tokens: int) -> Admitted:
        try:
            reserved = await self.reserve(request_id, caller.tenant, caller.principal.tier, caller.scopes(), tokens)
        except QuotaUnavailable as e:
            self._note_refused(caller)
            raise unavailable(f"quotas cannot be checked right now ({e}); please retry") from e
        except OverQuota as refused:
            self._note_refused(caller)
            raise _refusal(refused.decision, tokens, caller) from None
        assert reserved.reservation is not None  # a gateway always keeps a quota
        self._note_room(caller, reserved.headers)
        return Admitted(request_id, caller, reserved.reservation, headers=reserved.headers, ticket=reserved.ticket)

    def _note_room(self, caller: Caller, headers: Mapping[str, str] | None) -> None:
        if not self.ask_ahead:  # what may_ask_ahead reads, kept only when it is asked
            return
        if len(self._room) >= _MAX_CALLERS:
            self._room.clear()
        headers = headers or {}
        self._room[caller.scopes()[1].name] = _Room(
            time.monotonic(),
            float(headers.get("x-ratelimit-remaining-requests", math.inf)),
            float(headers.get("x-ratelimit-remaining-tokens", math.inf)),
        )

    def _note_refused(self, caller: Caller) -> None:
        if not self.ask_ahead:
            return
        if len(self._refused) >= _MAX_CALLERS:
            self._refused.clear()
        self._refused[caller.tenant] = time.monotonic()

    async def extend(self, admitted: Admitted, at_least: int, at_most: int) -> bool | None:
        """Reserves more tokens for a running request (budget.py): True when granted, False when its budgets are
        used up; None when the quota store cannot tell (the request goes on; its reconcile charges what it used)."""
        try:
            extended = await self.quota.extend(admitted.reservation, at_least, at_most)
        except (QuotaUnavailable, QuotaStoreError) as e:
            log.warning("cannot reserve more tokens for %s now: %s", admitted.request_id, e)
            return None
        if extended is None:
            return False
        admitted.reservation = extended
        return True

    async def queue(self, admitted: Admitted, model: str) -> None:
        """Waits for room in the model's pool; the caller must `leave` whatever happens after `reserve` succeeded."""
        assert admitted.ticket is not None
        admitted.model = model
        admitted.slot = await self.dispatchers[model].acquire(admitted.ticket)

    async def finish(self, admitted: Admitted, usage: Usage | None, choices: int = 1) -> None:
        """The request ended (finished, cancelled, failed or refused): refund or charge, free the slot."""
        if usage is not None:
            self.outputs.observe(
                admitted.caller.tenant,
                usage.completion_tokens // max(choices, 1),
                admitted.caller.tier.typical_output_tokens,
            )
        try:
            await self.leave(
                admitted.model, admitted.slot, admitted.reservation, 0 if usage is None else usage.total_tokens
            )
        except Exception:  # the quota store keeps pending reconciles itself; never fail the request for it
            log.exception("reconciling %s failed", admitted.request_id)


async def watch_load(
    admission: Admission, router, interval_s: float, slots_per_replica: int, prefill_tokens_per_s: float
) -> None:
    """Every interval, the admission core's load update over the router's pools: the replicas taking work per
    model, their queued prompt tokens and their measured prefill rates from their load reports (the router keeps
    those fresh; `prefill_tokens_per_s` stands in for a replica not measured yet)."""
    while True:
        taking = {model: router.models[model].taking() for model in admission.dispatchers}
        rate = sum(router.models[model].prefill_tokens_per_s(prefill_tokens_per_s) for model in admission.dispatchers)
        admission.update_load(taking, slots_per_replica, router.queued_tokens(), rate)
        await asyncio.sleep(interval_s)


def _refusal(decision: Decision, tokens: int, caller: Caller) -> APIError:
    scope = scope_label(decision.scope or "", caller)
    if decision.reason == "request_too_large":
        return rate_limited(
            f"Request too large for {scope}: it needs {tokens} tokens, more than the "
            "limit allows at once. Lower max_tokens or shorten the prompt.",
            decision.headers,
            code="request_too_large",
        )
    retry = decision.retry_after_s or 1.0
    return rate_limited(
        f"Rate limit reached for {(decision.reason or 'limit').replace('_', ' ')} on {scope}. "
        f"Please try again in {retry:.2f}s.",
        decision.headers,
    )


def scope_label(scope: str, caller: Caller) -> str:
    """A quota scope as people name it: the organisation's and the user's names, their ids beside them."""
    p = caller.principal
    if scope.startswith("user:"):
        return f"user {p.user_name!r} of organisation {p.org_name!r} ({p.org_id}/{p.user_id})"
    if scope.startswith("org:"):
        return f"organisation {p.org_name!r} ({p.org_id})"
    return scope
