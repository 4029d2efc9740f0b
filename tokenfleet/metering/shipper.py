"""Moves usage events from the outbox to the event log."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

from tokenfleet.metering.log import EventLog
from tokenfleet.metering.log import log as logger
from tokenfleet.metering.outage import Outage, raise_if_cancelled
from tokenfleet.metering.outbox import Outbox


class OutboxShipper:
    """Publishes pending outbox rows to the log, oldest first, then marks them sent.

    While the log (or the database) is unreachable the events stay in the outbox: the loop logs once per outage
    and retries with backoff, and never raises. Delivery is at least once: a crash (or cancellation) between
    publish and mark_sent publishes those events again next time, which is why the warehouse writer inserts
    idempotently on request_id.

    Sent is not written: the log may lose what it holds (Redis restarted without persistence, or trimmed it). A
    sent row the warehouse still lacks `reship_after_s` later is shipped again; sent rows are purged after
    `keep_sent_s` only once the warehouse has them."""

    def __init__(
        self,
        outbox: Outbox,
        log: EventLog,
        interval_s: float = 0.5,
        batch: int = 500,
        max_backoff_s: float = 30.0,
        keep_sent_s: float = 3600.0,
        reship_after_s: float = 300.0,
    ) -> None:
        if interval_s <= 0 or batch < 1 or max_backoff_s < interval_s or reship_after_s <= 0:
            raise ValueError("need interval_s > 0, batch >= 1, max_backoff_s >= interval_s and reship_after_s > 0")
        self.outbox, self.log, self.interval_s, self.batch = outbox, log, interval_s, batch
        self.keep_sent_s, self.reship_after_s = keep_sent_s, reship_after_s
        self.outage = Outage("usage shipper: event log or outbox", logger, interval_s, max_backoff_s)
        self.shipped = 0  # events published by this shipper (repeats included)
        self.reshipped = 0  # sent rows found missing from the warehouse and shipped again
        self._purged_at, self._checked_at = 0.0, time.monotonic()

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
                await self._reship_unwritten()
                await self._purge()
            except Exception as e:  # anything: the loop must outlive every outage; events wait in the outbox
                raise_if_cancelled(e)
                await asyncio.sleep(self.outage.failed(e))
                continue
            raise_if_cancelled()
            self.outage.recovered()
            if shipped < self.batch:
                await asyncio.sleep(self.interval_s)

    async def _reship_unwritten(self) -> None:
        """Every half `reship_after_s`: rows sent longer ago than that whose event is not in the warehouse go back
        to pending (shipped at the next round)."""
        now = time.monotonic()
        if now - self._checked_at < self.reship_after_s / 2:
            return
        self._checked_at = now
        lost = await self.outbox.resend_unwritten(timedelta(seconds=self.reship_after_s))
        if lost:
            self.reshipped += lost
            logger.warning(
                "usage outbox: %d event(s) sent over %.0f s ago are not in the warehouse (the event log "
                "lost them?); shipping them again",
                lost,
                self.reship_after_s,
            )

    async def _purge(self) -> None:
        now = time.monotonic()
        if now - self._purged_at < min(60.0, self.keep_sent_s):
            return
        self._purged_at = now
        purged = await self.outbox.purge_sent(timedelta(seconds=self.keep_sent_s))
        if purged:
            logger.debug("usage outbox: purged %d sent rows", purged)
