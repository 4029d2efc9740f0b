"""Admission of one request, in the order the design fixes: the overload ladder (shed before any GPU time), the
token quota (reserve input + expected output), then the dispatcher's fair queue (wait for room in the pool).
When the request ends, however it ends, the reservation is reconciled with what it used and its slot is freed."""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from tokenfleet.api.errors import APIError, rate_limited, unavailable
from tokenfleet.dispatch.overload import LoadSignal, OverloadLadder, Plan
from tokenfleet.dispatch.queue import Dispatcher
from tokenfleet.dispatch.tickets import Slot, Ticket
from tokenfleet.gateway.auth import Caller
from tokenfleet.quota.base import Decision, QuotaService, QuotaStoreError, QuotaUnavailable, Reservation

log = logging.getLogger(__name__)


@dataclass
class Admitted:
    request_id: str
    caller: Caller
    reservation: Reservation
    model: str = ""  # whose dispatch queue it waits in
    slot: Slot | None = None
    headers: Mapping[str, str] | None = None  # x-ratelimit-* for the response


class OutputEstimate:
    """A tenant's typical output length (moving average), reserved when a request gives no max_tokens."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight
        self._typical: dict[str, float] = {}

    def get(self, tenant: str, default: int) -> int:
        return math.ceil(self._typical.get(tenant, default))

    def observe(self, tenant: str, output_tokens: int, default: int) -> None:
        typical = self._typical.get(tenant, float(default))
        self._typical[tenant] = typical + self.weight * (output_tokens - typical)


class Admission:
    def __init__(self, quota: QuotaService, dispatchers: dict[str, Dispatcher], ladder: OverloadLadder) -> None:
        """One dispatcher (fair queue by tier, then tenant) per model; one quota and one ladder per gateway."""
        self.quota, self.dispatchers, self.ladder = quota, dispatchers, ladder
        self.outputs = OutputEstimate()
        self.batch_pace: dict[str, float] = {}  # model -> its batch tiers' tokens/s (the autoscaler's batch gate)
        self.shed: Counter[tuple[str]] = Counter()  # by (tier,)
        self.refusals: Counter[tuple[str, str]] = Counter()  # by (tier, reason)

    def plan(self, caller: Caller) -> Plan:
        """The overload ladder's verdict for a new request of this tier; a shed request never costs GPU time."""
        plan = self.ladder.plan(caller.principal.tier)
        if plan.action == "shed":
            self.shed[(caller.principal.tier,)] += 1
            log.info("shed a %s request of %s (overload level %d)", caller.principal.tier, caller.tenant, plan.level)
            retry = plan.retry_after_s or 1.0
            raise rate_limited(
                f"The service is under high demand; free-tier requests are paused. Please retry in {retry:.0f}s.",
                {"retry-after": str(math.ceil(retry)), "retry-after-ms": str(int(retry * 1000))},
                code="high_demand",
            )
        return plan

    def expected_tokens(self, caller: Caller, prompt_tokens: int, choices: int, max_tokens: int | None) -> int:
        output = (
            max_tokens if max_tokens is not None else self.outputs.get(caller.tenant, caller.tier.typical_output_tokens)
        )
        return prompt_tokens + choices * output

    async def reserve(self, request_id: str, caller: Caller, tokens: int) -> Admitted:
        try:
            decision = await self.quota.reserve(request_id, caller.scopes(), tokens, tier=caller.principal.tier)
        except QuotaUnavailable as e:
            raise unavailable(f"quotas cannot be checked right now ({e}); please retry") from e
        if not decision.allowed:
            self.refusals[(caller.principal.tier, decision.reason)] += 1
            raise _refusal(decision, tokens)
        return Admitted(request_id, caller, decision.reservation, headers=decision.headers)

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

    async def queue(self, admitted: Admitted, cost: int, model: str) -> None:
        """Waits for room in the model's pool; the caller must `leave` whatever happens after `reserve` succeeded."""
        ticket = Ticket(admitted.request_id, admitted.caller.tenant, admitted.caller.principal.tier, cost)
        admitted.model = model
        admitted.slot = await self.dispatchers[model].acquire(ticket)

    async def leave(self, admitted: Admitted, usage: dict | None, choices: int = 1) -> None:
        """The request ended (finished, cancelled, failed or refused): refund or charge, free the slot."""
        used = 0 if not usage else used_tokens(usage)
        if admitted.slot is not None:
            self.dispatchers[admitted.model].release(admitted.slot, used)
        if usage:
            self.outputs.observe(
                admitted.caller.tenant,
                usage.get("completion_tokens", 0) // max(choices, 1),
                admitted.caller.tier.typical_output_tokens,
            )
        try:
            await self.quota.reconcile(admitted.reservation, used)
        except Exception:  # the quota store keeps pending reconciles itself; never fail the request for it
            log.exception("reconciling %s failed", admitted.request_id)


async def watch_load(
    admission: Admission, router, interval_s: float, slots_per_replica: int, prefill_tokens_per_s: float
) -> None:
    """Every interval: size each model's dispatcher to its replicas taking work, project the time to first token
    from the queues and the replicas' load reports (the router keeps those fresh), move the overload ladder, and
    pause or resume the batch tier accordingly (paced to the spare capacity the autoscaler sees, if it gates it)."""
    while True:
        replicas = 0
        for model, dispatcher in admission.dispatchers.items():
            taking = sum(not r.draining for r in router.models[model].replicas.values())
            dispatcher.set_slots(slots_per_replica * taking)
            replicas += taking
        snapshots = [d.snapshot() for d in admission.dispatchers.values()]
        admission.ladder.update(
            LoadSignal(
                sum(s.served_queued_tokens for s in snapshots),
                router.queued_tokens(),
                sum(s.in_use for s in snapshots),
                sum(s.slots for s in snapshots),
                prefill_tokens_per_s * replicas,
            )
        )
        for model, dispatcher in admission.dispatchers.items():
            admission.ladder.apply(dispatcher, admission.batch_pace.get(model))
        await asyncio.sleep(interval_s)


def used_tokens(usage: dict) -> int:
    """What a request counts against its quota: its prompt and what it generated."""
    return usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)


def _refusal(decision: Decision, tokens: int) -> APIError:
    if decision.reason == "request_too_large":
        return rate_limited(
            f"Request too large for {decision.scope}: it needs {tokens} tokens, more than the "
            "limit allows at once. Lower max_tokens or shorten the prompt.",
            decision.headers,
            code="request_too_large",
        )
    retry = decision.retry_after_s or 1.0
    return rate_limited(
        f"Rate limit reached for {decision.reason.replace('_', ' ')} on {decision.scope}. "
        f"Please try again in {retry:.2f}s.",
        decision.headers,
    )
