"""Moves usage events from the outbox to the event log."""
from __future__ import annotations

import asyncio
import time
from datetime import timedelta

from tokenfleet.metering.log import EventLog, log as logger
from tokenfleet.metering.outage import Outage, raise_if_cancelled
from tokenfleet.metering.outbox import Outbox


class OutboxShipper:
    """Publishes pending outbox rows to the log, oldest first, then marks them sent.

    While the log (or the database) is unreachable the events stay in the outbox: the loop logs once per outage
    and retries with backoff, and never raises. Delivery is at least once: a crash (or cancellation) between
    publish and mark_sent publishes those events again next time, which is why the warehouse writer inserts
    idempotently on request_id. Sent rows are purged after `keep_sent_s`."""

    def __init__(self, outbox: Outbox, log: EventLog, interval_s: float = 0.5, batch: int = 500,
                 max_backoff_s: float = 30.0, keep_sent_s: float = 3600.0) -> None:
        if interval_s <= 0 or batch < 1 or max_backoff_s < interval_s:
            raise ValueError("need interval_s > 0, batch >= 1 and max_backoff_s >= interval_s")
        self.outbox, self.log, self.interval_s, self.batch = outbox, log, interval_s, batch
        self.keep_sent_s = keep_sent_s
        self.outage = Outage("usage shipper: event log or outbox", logger, interval_s, max_backoff_s)
        self.shipped = 0  # events published by this shipper (repeats included)
        self._purged_at = 0.0

    async def ship_once(self) -> int:
        """One batch: publish, then mark sent. Returns how many were shipped. Raises if the log is unreachable."""
        pending = await self.outbox.pending(self.batch)
        if not pending:
            return 0
        await self.log.publish([event for _, event in pending])
        await self.outbox.mark_sent([row_id for row_id, _ in pending])
        self.shipped += len(pending)
        return len(pending)

    async def run(self) -> None:
        """Ships until cancelled: a full batch goes on at once, otherwise it waits `interval_s`."""
        while True:
            try:
                shipped = await self.ship_once()
                await self._purge()
            except Exception as e:  # anything: the loop must outlive every outage; events wait in the outbox
                raise_if_cancelled(e)
                await asyncio.sleep(self.outage.failed(e))
                continue
            raise_if_cancelled()
            self.outage.recovered()
            if shipped < self.batch:
                await asyncio.sleep(self.interval_s)

    async def _purge(self) -> None:
        now = time.monotonic()
        if now - self._purged_at < min(60.0, self.keep_sent_s):
            return
        self._purged_at = now
        purged = await self.outbox.purge_sent(timedelta(seconds=self.keep_sent_s))
        if purged:
            logger.debug("usage outbox: purged %d sent rows", purged)
