"""The dispatcher: one per model pool. Requests wait in per-tier queues and leave for a replica when the pool has
room; every freed slot pulls the next ticket.

Order, when more wait than fit: first a provisioned tenant below its guaranteed share (reservations.py), then
weighted fair queuing across tiers by token cost (wfq.py), then deficit round-robin across the tenants of the
chosen tier (drr.py). Quotas (rate limits) are a separate mechanism that runs before a ticket gets here."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tokenfleet.dispatch.drr import TenantRoundRobin
from tokenfleet.dispatch.reservations import Reservations
from tokenfleet.dispatch.tickets import DispatchSnapshot, Slot, Ticket, TierSnapshot
from tokenfleet.dispatch.wfq import TierFairQueue

if TYPE_CHECKING:  # config imports torch; the dispatcher only needs each tier's weight and priority
    from tokenfleet.dispatch.tiers import TierConfig


class Grant(Protocol):
    """How a waiter gets its slot: an asyncio.Future, or anything with these three methods."""

    def done(self) -> bool: ...

    def set_result(self, result: Slot, /) -> None: ...

    def result(self) -> Slot: ...


@dataclass(eq=False)  # compared by identity: a queue finds and removes exactly this waiter
class _Waiter:
    ticket: Ticket
    future: Grant
    seq: int
    state: str = "queued"  # queued -> granted | gone
    reserved: bool = False

    @property
    def tenant(self) -> str:
        return self.ticket.tenant

    @property
    def cost(self) -> int:
        return self.ticket.cost

    @property
    def enqueued_at(self) -> float:
        return self.ticket.enqueued_at


class Submission:
    """What Dispatcher.submit returns, to hand back to Dispatcher.withdraw; opaque to the submitter."""

    __slots__ = ("_waiter",)

    def __init__(self, waiter: _Waiter) -> None:
        self._waiter = waiter


@dataclass(frozen=True)
class _Limit:
    """These tiers together are granted at most max_tokens (tickets' cost) within any window_s."""

    tiers: tuple[str, ...]
    max_tokens: int
    window_s: float


@dataclass
class _Tier:
    queue: TenantRoundRobin[_Waiter]
    paused: bool = False
    limit: _Limit | None = None
    # (when, cost) of its recent grants, kept while it has a limit
    granted: deque[tuple[float, int]] = field(default_factory=deque)
    granted_tokens: int = 0  # the costs in `granted`, summed
    dispatched: int = 0
    dispatched_tokens: int = 0
    wait_s_total: float = 0.0
    cancelled: int = 0
    in_use: int = 0


@dataclass
class _Pool:
    slots: int
    in_use: int = 0
    held: dict[int, Slot] = field(default_factory=dict)


def _check_slots(slots: int) -> int:
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
        raise ValueError(f"slots must be a whole number >= 0, got {slots!r}")
    return slots


class Dispatcher:
    """One model pool's queues. `slots` is the room in the pool (requests that may run at once across its
    replicas). Use it from one event loop; it is not thread-safe."""

    def __init__(
        self,
        tiers: Mapping[str, TierConfig],
        slots: int,
        quantum_tokens: int = 2048,
        provisioned: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        provisioned_window_s: float = 10.0,
    ) -> None:
        if not tiers:
            raise ValueError("a dispatcher needs at least one tier")
        self._clock = clock
        self._pool = _Pool(_check_slots(slots))
        self._tiers = {name: _Tier(TenantRoundRobin(quantum_tokens)) for name in tiers}
        self._fair = TierFairQueue({n: t.weight for n, t in tiers.items()}, {n: t.priority for n, t in tiers.items()})
        self._reservations = Reservations(provisioned or {}, provisioned_window_s, clock)
        self._reserved_queued: dict[str, int] = {}  # provisioned tenant -> its queued tickets, all tiers
        self._seq = itertools.count()
        self._slot_ids = itertools.count(1)

    @property
    def tier_names(self) -> tuple[str, ...]:
        return tuple(self._tiers)

    async def acquire(self, ticket: Ticket) -> Slot:
        """A slot for this ticket: at once when the pool has room for it, else after waiting its turn. Cancelling
        the waiting task takes the ticket out of its queue (and gives back a slot granted in the meantime)."""
        future: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        waiter = self._submit(ticket, future)
        try:
            return await future
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise

    def grants_at_once(self, tier: str) -> bool:
        """Whether a ticket of this tier would get its slot now, without waiting its turn."""
        state = self._tiers.get(tier)
        return state is not None and self._pool.in_use < self._pool.slots and self._serving(state)

    def submit(self, ticket: Ticket, future: Grant) -> Submission:
        """Queues a ticket without awaiting: `future.set_result(slot)` is called when it gets its slot, maybe
        before this returns. For callers without an event loop (the fleet simulator); `withdraw` takes it back."""
        return Submission(self._submit(ticket, future))

    def withdraw(self, submission: Submission) -> None:
        """The submitter gave up: out of its queue, or its slot given back if it was granted meanwhile."""
        self._abandon(submission._waiter)

    def _submit(self, ticket: Ticket, future: Grant) -> _Waiter:
        self._check_ticket(ticket)
        ticket.enqueued_at = self._clock()
        waiter = _Waiter(ticket, future, next(self._seq))
        self._enqueue(waiter)
        self._pump()
        return waiter

    def release(self, slot: Slot, served_tokens: int | None = None) -> None:
        """Free the slot for the next ticket; a second release of the same slot does nothing. `served_tokens`,
        when known, replaces the ticket's estimated cost in the fairness accounting."""
        if served_tokens is not None and (
            isinstance(served_tokens, bool) or not isinstance(served_tokens, int) or served_tokens < 0
        ):
            raise ValueError(f"served_tokens must be a whole number >= 0, got {served_tokens!r}")
        if self._pool.held.get(slot.slot_id) is not slot:
            return
        del self._pool.held[slot.slot_id]
        self._pool.in_use -= 1
        self._tiers[slot.ticket.tier].in_use -= 1
        slot.released = True
        if served_tokens is not None:
            self._reconcile(slot, served_tokens)
        self._pump()

    def set_slots(self, slots: int) -> None:
        """The pool's room changed. Shrinking takes no slot back: new grants wait until in_use is below it."""
        self._pool.slots = _check_slots(slots)
        self._pump()

    def pause(self, tier: str, paused: bool = True) -> None:
        """A paused tier keeps its queue (and takes new tickets) but gets no slots until unpaused."""
        self._tier(tier).paused = paused
        self._pump()

    def set_limit(self, tiers: Collection[str], max_tokens: int | None, window_s: float = 1.0) -> None:
        """These tiers together are granted at most `max_tokens` of tickets' cost within any `window_s` (None: no
        limit): a pace, so work that piled up while they were held back leaves at that pace, not all at once. A grant
        needs them below it (one ticket larger than the limit still goes alone). Tickets keep queueing meanwhile.
        Nothing wakes the queue when a window passes: the next submit, release or set_* call grants what is due
        (the gateway sets the limit again at every load update)."""
        names = tuple(dict.fromkeys(tiers))
        for name in names:
            self._tier(name)
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0
        ):
            raise ValueError(f"max_tokens must be a whole number >= 0 or None, got {max_tokens!r}")
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s!r}")
        limit = None if max_tokens is None else _Limit(names, max_tokens, window_s)
        for name in names:
            state = self._tiers[name]
            state.limit = limit
            if limit is None:
                state.granted.clear()
                state.granted_tokens = 0
        self._pump()

    def snapshot(self) -> DispatchSnapshot:
        now = self._clock()
        tiers = {name: self._tier_snapshot(state, now) for name, state in self._tiers.items()}
        return DispatchSnapshot(
            slots=self._pool.slots,
            in_use=self._pool.in_use,
            queued=sum(t.queued for t in tiers.values()),
            queued_tokens=sum(t.queued_tokens for t in tiers.values()),
            tiers=tiers,
        )

    # --- queueing ---------------------------------------------------------------------------------------------

    def _tier(self, name: str) -> _Tier:
        state = self._tiers.get(name)
        if state is None:
            raise ValueError(f"unknown tier {name!r}; known tiers: {', '.join(self._tiers)}")
        return state

    def _check_ticket(self, ticket: Ticket) -> None:
        self._tier(ticket.tier)
        if isinstance(ticket.cost, bool) or not isinstance(ticket.cost, int) or ticket.cost < 0:
            raise ValueError(
                f"ticket {ticket.request_id}: cost must be a whole number of tokens >= 0, got {ticket.cost!r}"
            )
        if not isinstance(ticket.tenant, str) or not ticket.tenant:
            raise ValueError(f"ticket {ticket.request_id}: tenant must be a non-empty string")

    def _enqueue(self, waiter: _Waiter) -> None:
        self._tiers[waiter.ticket.tier].queue.push(waiter)
        tenant = waiter.ticket.tenant
        if tenant in self._reservations.shares:
            count = self._reserved_queued.get(tenant, 0)
            if count == 0:
                self._reservations.became_backlogged(tenant)
            self._reserved_queued[tenant] = count + 1

    def _left_queue(self, waiter: _Waiter) -> None:
        tenant = waiter.ticket.tenant
        if tenant in self._reserved_queued:
            count = self._reserved_queued[tenant] - 1
            if count:
                self._reserved_queued[tenant] = count
            else:
                del self._reserved_queued[tenant]

    def _abandon(self, waiter: _Waiter) -> None:
        if waiter.state == "queued":
            self._tiers[waiter.ticket.tier].queue.remove(waiter)
            self._left_queue(waiter)
            self._gone(waiter)
        elif waiter.state == "granted":  # the slot came just as the task was cancelled
            self.release(waiter.future.result())

    def _gone(self, waiter: _Waiter) -> None:
        waiter.state = "gone"
        self._tiers[waiter.ticket.tier].cancelled += 1

    # --- dispatching ------------------------------------------------------------------------------------------

    def _pump(self) -> None:
        while self._pool.in_use < self._pool.slots:
            waiter = self._next_waiter()
            if waiter is None:
                return
            self._grant(waiter)

    def _next_waiter(self) -> _Waiter | None:
        while True:
            waiter = self._pick_reserved() or self._pick_fair()
            if waiter is None:
                return None
            self._left_queue(waiter)
            if not waiter.future.done():
                return waiter
            # cancelled, but its task has not run yet to take it out of the queue
            self._gone(waiter)

    def _pick_reserved(self) -> _Waiter | None:
        if not self._reserved_queued:
            return None
        for tenant in self._reservations.behind(self._reserved_queued):
            heads = [tier.queue.head(tenant) for tier in self._tiers.values() if self._serving(tier)]
            waiting = [head for head in heads if head is not None]
            if waiting:
                waiter = min(waiting, key=lambda w: w.seq)
                self._tiers[waiter.ticket.tier].queue.remove(waiter)
                waiter.reserved = True
                return waiter
        return None

    def _pick_fair(self) -> _Waiter | None:
        backlogged = [name for name, tier in self._tiers.items() if tier.queue.queued and self._serving(tier)]
        name = self._fair.choose(backlogged)
        return None if name is None else self._tiers[name].queue.pop()

    def _serving(self, tier: _Tier) -> bool:
        return not tier.paused and not self._at_limit(tier)

    def _at_limit(self, tier: _Tier) -> bool:
        limit = tier.limit
        if limit is None:
            return False
        since, total = self._clock() - limit.window_s, 0
        for name in limit.tiers:
            state = self._tiers[name]
            granted = state.granted
            while granted and granted[0][0] <= since:
                state.granted_tokens -= granted.popleft()[1]
            total += state.granted_tokens
        return total >= limit.max_tokens

    def _grant(self, waiter: _Waiter) -> None:
        ticket, now = waiter.ticket, self._clock()
        slot = Slot(
            next(self._slot_ids),
            ticket,
            granted_at=now,
            waited_s=max(0.0, now - ticket.enqueued_at),
            reserved=waiter.reserved,
        )
        if not waiter.reserved:  # reserved capacity is carved out of the pool, not charged to the tier's share
            self._fair.charge(ticket.tier, ticket.cost)
        if self._reservations:
            slot.usage = self._reservations.record(ticket.tenant, ticket.cost)
        tier = self._tiers[ticket.tier]
        tier.dispatched += 1
        tier.dispatched_tokens += ticket.cost
        tier.wait_s_total += slot.waited_s
        tier.in_use += 1
        if tier.limit is not None:
            tier.granted.append((now, ticket.cost))
            tier.granted_tokens += ticket.cost
        self._pool.in_use += 1
        self._pool.held[slot.slot_id] = slot
        waiter.state = "granted"
        waiter.future.set_result(slot)

    def _reconcile(self, slot: Slot, served_tokens: int) -> None:
        delta = served_tokens - slot.ticket.cost
        if not slot.reserved:
            self._fair.adjust(slot.ticket.tier, delta)
        if slot.usage is not None:
            self._reservations.reconcile(slot.usage, served_tokens)

    def _tier_snapshot(self, tier: _Tier, now: float) -> TierSnapshot:
        oldest = tier.queue.oldest_enqueued_at()
        return TierSnapshot(
            queued=tier.queue.queued,
            queued_tokens=tier.queue.queued_tokens,
            oldest_wait_s=0.0 if oldest is None else max(0.0, now - oldest),
            paused=tier.paused,
            dispatched=tier.dispatched,
            dispatched_tokens=tier.dispatched_tokens,
            wait_s_total=tier.wait_s_total,
            cancelled=tier.cancelled,
            in_use=tier.in_use,
            at_limit=self._at_limit(tier),
        )
