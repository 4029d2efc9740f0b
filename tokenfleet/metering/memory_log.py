"""The usage log when embedded: in process, with the Redis Stream's semantics (pending entries, ack, redelivery
of entries left un-acked past the claim time). It dies with the process; `Outbox.resend_unwritten()` at start-up
sends again what it held."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from tokenfleet.metering.event import UsageEvent
from tokenfleet.metering.log import Entry


@dataclass
class _Delivery:
    consumer: str
    at: float  # time.monotonic() of the last delivery


class MemoryLog:
    def __init__(self, maxlen: int = 1_000_000, claim_idle_ms: int = 30_000) -> None:
        if maxlen < 1 or claim_idle_ms < 1:
            raise ValueError("maxlen and claim_idle_ms must be positive")
        self.maxlen, self.claim_idle_ms = maxlen, claim_idle_ms
        self._entries: dict[str, UsageEvent] = {}  # every un-acked entry, oldest first
        self._new: deque[str] = deque()  # never delivered, oldest first
        self._pending: dict[str, _Delivery] = {}
        self._sequence = 0
        self._arrived = asyncio.Event()

    async def publish(self, events: Sequence[UsageEvent]) -> list[str]:
        for event in events:
            if not isinstance(event, UsageEvent):
                raise ValueError(f"only UsageEvent can be published, got {type(event).__name__}")
        ids = []
        for event in events:
            self._sequence += 1
            entry_id = f"{self._sequence}-0"
            self._entries[entry_id] = event
            self._new.append(entry_id)
            ids.append(entry_id)
        self._trim()
        if ids:
            self._arrived.set()
        return ids

    async def read(self, consumer: str, count: int = 100, block_ms: int = 1000) -> list[Entry]:
        if count < 1 or block_ms < 0:
            raise ValueError("count must be at least 1 and block_ms at least 0")
        deadline = time.monotonic() + block_ms / 1000
        while True:
            ids = self._claim(consumer, count) or self._take_new(consumer, count)
            remaining = deadline - time.monotonic()
            if ids or remaining <= 0:
                return [(entry_id, self._entries[entry_id]) for entry_id in ids]
            self._arrived.clear()  # nothing is available and nothing awaited since the check: no lost wake-up
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                pass

    async def ack(self, entry_ids: Sequence[str]) -> None:
        for entry_id in entry_ids:
            if self._pending.pop(entry_id, None) is not None:
                del self._entries[entry_id]

    async def close(self) -> None:
        pass

    def _claim(self, consumer: str, count: int) -> list[str]:
        now = time.monotonic()
        idle = self.claim_idle_ms / 1000
        stale = [entry_id for entry_id, d in self._pending.items() if now - d.at >= idle][:count]
        for entry_id in stale:
            self._pending[entry_id] = _Delivery(consumer, now)
        return stale

    def _take_new(self, consumer: str, count: int) -> list[str]:
        now = time.monotonic()
        ids = [self._new.popleft() for _ in range(min(count, len(self._new)))]
        for entry_id in ids:
            self._pending[entry_id] = _Delivery(consumer, now)
        return ids

    def _trim(self) -> None:
        """Like MAXLEN: the oldest entries go, delivered or not."""
        while len(self._entries) > self.maxlen:
            oldest = next(iter(self._entries))
            del self._entries[oldest]
            self._pending.pop(oldest, None)
            if self._new and self._new[0] == oldest:
                self._new.popleft()
