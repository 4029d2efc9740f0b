"""Deficit round-robin across the tenants of one tier, with each tenant's requests in its own FIFO.

A tenant that had nothing queued joins a "new" list served before the round of backlogged tenants (the sparse-flow
rule of FQ-CoDel, RFC 8290): a light tenant's first request waits for no more of a heavy tenant's work than is
already running. A new tenant that spends its quantum, or empties, moves to the end of the round, so arriving often
buys at most one early turn per round — which means a light tenant that sends again within the same round waits
out the heavy tenant's whole turn (up to one quantum of its tokens): keep the quantum near one typical request's
cost (docs/benchmarks/fair_share.md measures both). Backlogged tenants get `quantum` tokens per turn, carrying what they did not
spend, so over time each gets the same tokens whatever its request sizes; one turn is at most one quantum plus
the carried remainder (less than one request)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class Queued(Protocol):
    @property
    def cost(self) -> int: ...

    @property
    def tenant(self) -> str: ...

    @property
    def enqueued_at(self) -> float: ...


QueuedT = TypeVar("QueuedT", bound=Queued)


@dataclass
class _Tenant(Generic[QueuedT]):
    fifo: deque[QueuedT] = field(default_factory=deque)
    deficit: int = 0


class TenantRoundRobin(Generic[QueuedT]):
    def __init__(self, quantum: int) -> None:
        if isinstance(quantum, bool) or not isinstance(quantum, int) or quantum < 1:
            raise ValueError(f"quantum_tokens must be a positive whole number of tokens, got {quantum!r}")
        self.quantum = quantum
        self._tenants: dict[str, _Tenant[QueuedT]] = {}  # every tenant listed in _new or _old, maybe with an empty FIFO
        self._new: deque[str] = deque()
        self._old: deque[str] = deque()
        self.queued = 0
        self.queued_tokens = 0

    def push(self, item: QueuedT) -> None:
        state = self._tenants.get(item.tenant)
        if state is None:
            state = self._tenants[item.tenant] = _Tenant(deficit=self.quantum)
            self._new.append(item.tenant)
        state.fifo.append(item)
        self.queued += 1
        self.queued_tokens += item.cost

    def pop(self) -> QueuedT | None:
        """The next item by deficit round-robin, or None when nothing is queued."""
        fruitless = 0  # turns in a row that dispatched nothing
        while self._new or self._old:
            ring = self._new or self._old
            tenant = ring[0]
            state = self._tenants[tenant]
            if not state.fifo:
                ring.popleft()
                if ring is self._new:
                    self._old.append(tenant)
                else:
                    del self._tenants[tenant]
                continue
            if state.fifo[0].cost <= state.deficit:
                state.deficit -= state.fifo[0].cost
                return self._take(state)
            state.deficit += self.quantum
            ring.popleft()
            self._old.append(tenant)
            fruitless += 1
            if not self._new and fruitless > len(self._old):
                self._fast_forward()
                fruitless = 0
        return None

    def head(self, tenant: str) -> QueuedT | None:
        state = self._tenants.get(tenant)
        return state.fifo[0] if state is not None and state.fifo else None

    def remove(self, item: QueuedT) -> bool:
        """Take `item` out wherever it is (cancelled, or dispatched out of turn); its tenant keeps its place."""
        state = self._tenants.get(item.tenant)
        if state is None:
            return False
        for i, queued in enumerate(state.fifo):
            if queued is item:
                del state.fifo[i]
                self.queued -= 1
                self.queued_tokens -= item.cost
                return True
        return False

    def oldest_enqueued_at(self) -> float | None:
        heads = [state.fifo[0].enqueued_at for state in self._tenants.values() if state.fifo]
        return min(heads, default=None)

    def _take(self, state: _Tenant[QueuedT]) -> QueuedT:
        item = state.fifo.popleft()
        self.queued -= 1
        self.queued_tokens -= item.cost
        return item

    def _fast_forward(self) -> None:
        """A whole round passed without a dispatch (requests larger than a quantum): grant every tenant the rounds
        it would take until the first of them can go, at once; the same outcome as looping that many rounds."""
        waiting = [self._tenants[t] for t in self._old if self._tenants[t].fifo]
        rounds = min((math.ceil((s.fifo[0].cost - s.deficit) / self.quantum) for s in waiting), default=0)
        if rounds > 0:
            for state in waiting:
                state.deficit += rounds * self.quantum
