"""Admission's rules, in the order the design fixes, with one home for the gateway and the simulator: the overload
ladder's verdict (shed before any GPU time; a smaller max_tokens or another model for some tiers), the token
quota's reservation (input + expected output), a ticket for the model's fair queue; and when the request ends, its
slot freed and its reservation reconciled with what it used. Every periodic load update (size each pool, project
the time to first token, move the ladder, pause or pace the batch tier) is here too.

It does no I/O of its own. The quota is the caller's backend: awaited by the gateway (Redis), run to completion at
once by the simulator (the in-memory backend never suspends). Waiting for a slot is the caller's too: an asyncio
future in the gateway, a callback on the simulated clock."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenfleet.dispatch.overload import LoadSignal, OverloadLadder, Plan
from tokenfleet.dispatch.queue import Dispatcher
from tokenfleet.dispatch.tickets import Slot, Ticket
from tokenfleet.quota.base import Decision, QuotaService, Reservation, Scope


class Shed(Exception):
    """The overload ladder turns this tier away before it costs any GPU time."""

    def __init__(self, plan: Plan) -> None:
        super().__init__(f"shed at overload level {plan.level}")
        self.plan = plan


class OverQuota(Exception):
    """The token quota has no room for the request now (or ever, for `request_too_large`)."""

    def __init__(self, decision: Decision, tokens: int) -> None:
        super().__init__(f"{decision.reason} on {decision.scope}")
        self.decision, self.tokens = decision, tokens


@dataclass
class Reserved:
    """A request the quota let in: what it reserved, and its ticket for the fair queue."""

    ticket: Ticket
    reservation: Reservation | None  # None where no quota is kept (a simulation without one)
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


class AdmissionCore:
    def __init__(
        self, quota: QuotaService | None, dispatchers: Mapping[str, Dispatcher], ladder: OverloadLadder
    ) -> None:
        """One dispatcher (fair queue by tier, then tenant) per model; one quota and one ladder per gateway."""
        self.quota, self.dispatchers, self.ladder = quota, dispatchers, ladder
        self.outputs = OutputEstimate()
        self.batch_pace: dict[str, float] = {}  # model -> its batch tiers' tokens/s (the autoscaler's batch gate)
        self.shed: Counter[tuple[str]] = Counter()  # by (tier,)
        self.refusals: Counter[tuple[str, str]] = Counter()  # by (tier, reason)

    def plan(self, tier: str) -> Plan:
        """The ladder's verdict for a new request of this tier; raises Shed when it is turned away."""
        plan = self.ladder.plan(tier)
        if plan.action == "shed":
            self.shed[(tier,)] += 1
            raise Shed(plan)
        return plan

    def expected_tokens(
        self, tenant: str, typical_output: int, prompt_tokens: int, choices: int, max_tokens: int | None
    ) -> int:
        """What to reserve: the prompt, and for each choice its max_tokens or else the tenant's typical output."""
        output = max_tokens if max_tokens is not None else self.outputs.get(tenant, typical_output)
        return prompt_tokens + choices * output

    async def reserve(self, request_id: str, tenant: str, tier: str, scopes: Sequence[Scope], tokens: int) -> Reserved:
        """Reserves the tokens in every scope at once; raises OverQuota when any has no room (the quota backend's
        own errors, e.g. QuotaUnavailable, pass through)."""
        ticket = Ticket(request_id, tenant, tier, tokens)
        if self.quota is None:
            return Reserved(ticket, None)
        decision = await self.quota.reserve(request_id, scopes, tokens, tier=tier)
        if not decision.allowed:
            self.refusals[(tier, decision.reason or "refused")] += 1
            raise OverQuota(decision, tokens)
        return Reserved(ticket, decision.reservation, decision.headers)

    async def leave(self, model: str, slot: Slot | None, reservation: Reservation | None, used: int) -> None:
        """The request ended (finished, cancelled, failed or refused): its slot is freed first, then what it used
        is charged and the rest of its reservation given back."""
        if slot is not None:
            self.dispatchers[model].release(slot, used)
        if self.quota is not None and reservation is not None:
            await self.quota.reconcile(reservation, used)

    def update_load(
        self,
        taking: Mapping[str, int],
        slots_per_replica: int,
        replica_queued_tokens: int,
        pool_prefill_tokens_per_s: float,
    ) -> int:
        """One load interval: size each model's pool to its replicas taking work (`taking`), project the time to
        first token from the queues and the replicas' own queues at the pool's prefill rate (all the replicas
        taking work together), move the ladder, then pause or pace each model's batch tier. Returns the ladder's
        level."""
        for model, dispatcher in self.dispatchers.items():
            dispatcher.set_slots(slots_per_replica * taking.get(model, 0))
        snapshots = [d.snapshot() for d in self.dispatchers.values()]
        level = self.ladder.update(
            LoadSignal(
                sum(s.served_queued_tokens for s in snapshots),
                replica_queued_tokens,
                sum(s.in_use for s in snapshots),
                sum(s.slots for s in snapshots),
                pool_prefill_tokens_per_s,
            )
        )
        for model, dispatcher in self.dispatchers.items():
            self.ladder.apply(dispatcher, self.batch_pace.get(model))
        return level
