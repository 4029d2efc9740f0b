"""The warehouse writer: usage events from the log into `usage_events`, one row per request exactly once."""

from __future__ import annotations

import asyncio
from typing import Any

from tokenfleet.metering.event import UsageEvent
from tokenfleet.metering.log import Entry, EventLog
from tokenfleet.metering.log import log as logger
from tokenfleet.metering.outage import Outage, raise_if_cancelled
from tokenfleet.metering.sql import insert_ignoring
from tokenfleet.store.db import Database
from tokenfleet.store.models import UsageEventRow, utcnow

WAREHOUSE = UsageEventRow.__table__


def warehouse_row(event: UsageEvent) -> dict[str, Any]:
    row = event.to_dict()
    row.update(started_at=event.started_at, ended_at=event.ended_at, day=event.day, created_at=utcnow())
    return row


class WarehouseWriter:
    """Reads a batch from the log, inserts it with ON CONFLICT (request_id) DO NOTHING, then acks it.

    Exactly once in the table from at-least-once delivery: an event published twice, or redelivered because a
    writer died between insert and ack, meets its own row and is skipped. A batch whose insert or ack failed is
    kept and tried again (not read anew), so nothing waits for the claim time while this writer lives; entries of
    a writer that died are claimed by another after the log's claim_idle_ms (or at once by a writer started again
    under the same consumer name, on Redis)."""

    def __init__(
        self,
        db: Database,
        log: EventLog,
        consumer_name: str,
        batch: int = 500,
        block_ms: int = 1000,
        max_backoff_s: float = 30.0,
    ) -> None:
        if not consumer_name or batch < 1 or block_ms < 0:
            raise ValueError("need a consumer_name, batch >= 1 and block_ms >= 0")
        self.db, self.log, self.consumer_name = db, log, consumer_name
        self.batch, self.block_ms = batch, block_ms
        self.outage = Outage(f"warehouse writer {consumer_name}: event log or database", logger, 0.5, max_backoff_s)
        self.written = 0  # rows this writer inserted
        self.duplicates = 0  # entries whose row was already there (repeats, redeliveries, retried batches)
        self._held: list[Entry] = []  # read but not yet acked

    async def drain_once(self, block_ms: int | None = None) -> int:
        """Handles one batch (waiting up to block_ms for one, default the writer's). Returns how many entries it
        acked. Raises when the log or the database is unreachable; the batch is kept for the next call."""
        if not self._held:
            wait = self.block_ms if block_ms is None else block_ms
            self._held = await self.log.read(self.consumer_name, self.batch, wait)
        if not self._held:
            return 0
        events = {event.request_id: event for _, event in self._held}  # a batch may hold one event twice
        async with self.db.session() as session, session.begin():
            added = await insert_ignoring(
                session, WAREHOUSE, [warehouse_row(e) for e in events.values()], key="request_id"
            )
        self.written += added
        self.duplicates += len(self._held) - added
        await self.log.ack([entry_id for entry_id, _ in self._held])
        acked, self._held = len(self._held), []
        return acked

    async def run(self) -> None:
        """Writes until cancelled; never raises on an outage (logged once, retried with backoff)."""
        while True:
            try:
                drained = await self.drain_once()
            except Exception as e:  # the loop must outlive every outage: un-acked entries stay in the log
                raise_if_cancelled(e)
                await asyncio.sleep(self.outage.failed(e))
                continue
            raise_if_cancelled()
            self.outage.recovered()
            if not drained and self.block_ms == 0:
                await asyncio.sleep(0.1)  # reads that do not wait would spin
