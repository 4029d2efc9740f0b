"""The gateway's admission in simulated time: the gateway's own admission core (dispatch/admission.py: the overload
ladder, the token quota on the simulated clock, the fair queue's tickets and load updates), with the wait for a
slot as a callback (Dispatcher.submit) instead of an asyncio future."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenfleet.dispatch.admission import AdmissionCore, OverQuota, Shed
from tokenfleet.dispatch.overload import OverloadLadder
from tokenfleet.dispatch.queue import Dispatcher, Submission
from tokenfleet.dispatch.tickets import Slot
from tokenfleet.dispatch.tiers import TierConfig
from tokenfleet.quota.base import Scope, scopes_for
from tokenfleet.quota.memory import MemoryQuota
from tokenfleet.sim.events import SimClock
from tokenfleet.sim.request import SimRequest

POOL = "sim"  # the simulated fleet serves one model from one pool


def run_now(coroutine):
    """The result of a coroutine that never suspends (MemoryQuota's methods never await anything)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the coroutine suspended; only non-blocking backends can run in the simulator")


@dataclass(eq=False)
class _Grant:
    """The dispatcher's future, resolved synchronously: the callback runs when the slot is granted."""

    callback: Callable[[Slot], None]
    slot: Slot | None = None
    cancelled: bool = False

    def done(self) -> bool:
        return self.slot is not None or self.cancelled

    def set_result(self, slot: Slot) -> None:
        self.slot = slot
        self.callback(slot)

    def result(self) -> Slot:
        return self.slot


class SimGateway:
    def __init__(
        self,
        tiers: dict[str, TierConfig],
        clock: SimClock,
        ladder: OverloadLadder,
        dispatcher: Dispatcher,
        quota: MemoryQuota | None,
    ) -> None:
        self.tiers, self.clock, self.ladder, self.dispatcher = tiers, clock, ladder, dispatcher
        self.core = AdmissionCore(quota, {POOL: dispatcher}, ladder)
        self._scopes: dict[tuple[str, str, str], tuple[Scope, Scope]] = {}
        self._waiting: dict[SimRequest, tuple[Submission, _Grant]] = {}

    @property
    def batch_pace(self) -> float | None:
        """The autoscaler's batch gate: the batch tiers' tokens/s, or None when it does not gate them."""
        return self.core.batch_pace.get(POOL)

    @batch_pace.setter
    def batch_pace(self, pace: float | None) -> None:
        if pace is None:
            self.core.batch_pace.pop(POOL, None)
        else:
            self.core.batch_pace[POOL] = pace

    def admit(self, sreq: SimRequest, on_slot: Callable[[SimRequest], None]) -> str | None:
        """Ladder, quota, fair queue. Returns why it was refused ("shed", "quota"), or None: `on_slot(sreq)` runs
        when it has its slot (maybe before this returns)."""
        try:
            plan = self.core.plan(sreq.tier)
        except Shed:
            return "shed"
        if plan.max_tokens_cap is not None:
            sreq.max_tokens = min(sreq.max_tokens, plan.max_tokens_cap)
        tokens = self.core.expected_tokens(sreq.tenant, 0, len(sreq.prompt), 1, sreq.max_tokens)
        try:
            reserved = run_now(self.core.reserve(sreq.rid, sreq.tenant, sreq.tier, self._scopes_of(sreq), tokens))
        except OverQuota:
            return "quota"
        sreq.reservation = reserved.reservation
        grant = _Grant(lambda slot: self._granted(sreq, slot, on_slot))
        handle = self.dispatcher.submit(reserved.ticket, grant)
        if grant.slot is None:
            self._waiting[sreq] = (handle, grant)
        return None

    @property
    def queued(self) -> int:
        """Requests waiting in the fair queue for a slot."""
        return len(self._waiting)

    def _granted(self, sreq: SimRequest, slot: Slot, on_slot: Callable[[SimRequest], None]) -> None:
        self._waiting.pop(sreq, None)
        sreq.slot, sreq.admitted = slot, self.clock.now
        on_slot(sreq)

    def withdraw(self, sreq: SimRequest) -> bool:
        """The client left while queued: out of the fair queue. False if it was not waiting there."""
        waiting = self._waiting.pop(sreq, None)
        if waiting is None:
            return False
        handle, grant = waiting
        grant.cancelled = True
        self.dispatcher.withdraw(handle)
        return True

    def leave(self, sreq: SimRequest) -> None:
        """The request ended however it ended: free the slot, reconcile the reservation with what it used."""
        used = len(sreq.prompt) + sreq.tokens_out if sreq.req is not None else 0
        run_now(self.core.leave(POOL, sreq.slot, sreq.reservation, used))

    def update_load(
        self, replicas: int, slots_per_replica: int, replica_queued_tokens: int, prefill_tokens_per_s: float
    ) -> int:
        """What watch_load does every interval: size the pool, project TTFT, move the ladder, pause batch from
        level 1 and pace it to the autoscaler's batch gate."""
        return self.core.update_load(
            {POOL: replicas}, slots_per_replica, replica_queued_tokens, prefill_tokens_per_s * replicas
        )

    def _scopes_of(self, sreq: SimRequest) -> tuple[Scope, Scope]:
        key = (sreq.tier, sreq.tenant, sreq.user)
        scopes = self._scopes.get(key)
        if scopes is None:
            tier = self.tiers[sreq.tier]
            scopes = self._scopes[key] = scopes_for(sreq.tenant, sreq.user, tier.org_limits, tier.user_limits)
        return scopes
