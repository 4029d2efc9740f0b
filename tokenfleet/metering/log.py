"""The event log between the outbox and the warehouse, behind one interface: a Redis Stream with a consumer group
in a fleet (redis_log.py), an in-process log when embedded (memory_log.py).

Delivery is at least once. An entry a consumer read stays pending until it is acked; if that consumer dies, the
entry goes to another reader once it has been idle for `claim_idle_ms`. Publishing may also repeat an event (a
shipper that crashed before marking it sent), so consumers must be idempotent on request_id."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from tokenfleet.metering.event import UsageEvent

log = logging.getLogger("tokenfleet.metering")

Entry = tuple[str, UsageEvent]  # (entry id, event)


class EventLog(Protocol):
    async def publish(self, events: Sequence[UsageEvent]) -> list[str]:
        """Appends the events in order; returns their entry ids. Raises when the log is unreachable."""

    async def read(self, consumer: str, count: int = 100, block_ms: int = 1000) -> list[Entry]:
        """Up to `count` entries for `consumer`: entries abandoned by a dead consumer (idle past the claim time)
        first, then new ones, waiting up to `block_ms` for some to arrive (0: do not wait). [] when none."""

    async def ack(self, entry_ids: Sequence[str]) -> None:
        """The entries are processed: they are never delivered again."""

    async def close(self) -> None: ...


def decode(entry_id: str, payload: str | bytes | None) -> UsageEvent | None:
    """The entry's event, or None (logged) when it cannot be one: such an entry is acked and dropped, because
    redelivering it would fail the same way forever."""
    try:
        if payload is None:
            raise ValueError("the entry has no event field")
        return UsageEvent.from_json(payload)
    except ValueError as e:
        log.error("dropping usage log entry %s: %s (payload %.500r)", entry_id, e, payload)
        return None
