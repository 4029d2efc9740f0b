"""A discrete-event pool that drives the real Dispatcher on a fake clock: each granted ticket holds its slot for
cost / tokens_per_s seconds of fake time, then is released. Nothing sleeps."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenfleet.dispatch import Dispatcher, Slot, Ticket


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def settle() -> None:
    """Let every task woken by a grant run up to its next wait."""
    for _ in range(4):
        await asyncio.sleep(0)


class Grant:
    """A synchronous grant for Dispatcher.submit."""

    def __init__(self) -> None:
        self.slot = None

    def done(self) -> bool:
        return self.slot is not None

    def set_result(self, slot) -> None:
        self.slot = slot

    def result(self):
        return self.slot


@dataclass
class PoolSim:
    dispatcher: Dispatcher
    clock: FakeClock
    tokens_per_s: float = 1000.0  # per slot
    on_grant: Callable[[Slot], None] | None = None
    grants: list[Slot] = field(default_factory=list)  # in grant order
    completed: list[tuple[float, Slot]] = field(default_factory=list)  # (finished at, slot)
    _running: list = field(default_factory=list)  # heap of (finishes at, seq, slot)
    _seq: itertools.count = field(default_factory=itertools.count)
    _tasks: set = field(default_factory=set)

    def submit(self, ticket: Ticket) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(self._hold(ticket))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _hold(self, ticket: Ticket) -> Slot:
        slot = await self.dispatcher.acquire(ticket)
        self.grants.append(slot)
        heapq.heappush(self._running, (self.clock.now + ticket.cost / self.tokens_per_s, next(self._seq), slot))
        if self.on_grant is not None:
            self.on_grant(slot)
        return slot

    async def step(self) -> bool:
        """Finish the next running ticket (advancing the clock); False when nothing runs."""
        await settle()
        if not self._running:
            return False
        finishes_at, _, slot = heapq.heappop(self._running)
        self.clock.now = max(self.clock.now, finishes_at)
        self.completed.append((self.clock.now, slot))
        self.dispatcher.release(slot)
        await settle()
        return True

    async def run(self, grants: int) -> None:
        while len(self.grants) < grants and await self.step():
            pass

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def keep_backlogged(sim: PoolSim, make_ticket: Callable[[str, str], Ticket]) -> Callable[[Slot], None]:
    """An on_grant hook: every granted ticket is replaced by a new one from the same tenant and tier."""

    def replace(slot: Slot) -> None:
        sim.submit(make_ticket(slot.ticket.tenant, slot.ticket.tier))

    return replace
