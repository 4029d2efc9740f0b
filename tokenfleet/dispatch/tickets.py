"""The records the dispatcher hands out: a ticket (a request waiting for room), a slot (room granted), snapshots."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenfleet.dispatch.reservations import Usage


@dataclass
class Ticket:
    """One request asking for room in a model's pool. `cost` is in tokens (input + expected output), the unit of
    fairness. `enqueued_at` is stamped by Dispatcher.acquire on the dispatcher's clock; waits are measured from it."""

    request_id: str
    tenant: str  # organisation id
    tier: str  # a key of the dispatcher's tiers mapping
    cost: int
    enqueued_at: float = field(default_factory=time.monotonic)


@dataclass
class Slot:
    """Room for one request in the pool, held until Dispatcher.release. `reserved` is true when the ticket went
    ahead of fair queuing because its tenant was below its provisioned share."""

    slot_id: int
    ticket: Ticket
    granted_at: float
    waited_s: float
    reserved: bool = False
    released: bool = False
    usage: Usage | None = field(default=None, repr=False, compare=False)  # the dispatcher's throughput-window entry


@dataclass
class TierSnapshot:
    queued: int  # requests waiting
    queued_tokens: int
    oldest_wait_s: float  # 0 when nothing waits
    paused: bool
    # counters since the dispatcher started
    dispatched: int
    dispatched_tokens: int
    wait_s_total: float  # summed over dispatched requests
    cancelled: int  # left the queue without a slot
    in_use: int = 0  # slots its requests hold now
    at_limit: bool = False  # it (with the tiers sharing its limit) got all its limit allows for now


@dataclass
class DispatchSnapshot:
    slots: int  # room in the pool now
    in_use: int  # may exceed slots for a while after the pool shrinks
    queued: int
    queued_tokens: int
    tiers: dict[str, TierSnapshot]

    @property
    def served_queued_tokens(self) -> int:
        """Queued tokens of the tiers being served: a paused tier's queue, or one at its limit, is ahead of no one.
        (Counting it kept the overload ladder's projected TTFT up once it paused batch, so it never came back down
        while batch arrived.)"""
        return sum(t.queued_tokens for t in self.tiers.values() if not (t.paused or t.at_limit))
