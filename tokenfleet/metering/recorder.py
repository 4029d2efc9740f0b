"""The gateway's side of metering: every request's row in the outbox, opened when it starts, kept alive while it
runs and closed with the final event when it ends. No write is on a request's path: they run in the background,
and a close that fails (the database is down) is kept in memory and retried until it lands.

Writes are group-committed: the opens and closes of all requests that started or ended within `batch_s` of each
other go to the database in one statement, and while one batch is being written the next one gathers. A request that
ends before its open was written is written once, by its close. The close of a request whose row is already open
waits up to `close_batch_s` to ride along with a later batch: its row already holds the request (and a lease a
dead gateway's reaper acts on), so there is no hurry, and a gateway serving a request at a time writes one batch per
request instead of two (each batch costs the event loop ~0.3-0.6 ms, which it takes from some request's path)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta

from tokenfleet.metering.event import UsageEvent
from tokenfleet.metering.log import log
from tokenfleet.metering.outage import Outage, raise_if_cancelled
from tokenfleet.metering.outbox import Outbox, Reconcile
from tokenfleet.store.models import utcnow

Snapshot = Callable[[], UsageEvent]  # the request's event as of now (counts so far)


class UsageRecorder:
    def __init__(
        self,
        outbox: Outbox,
        lease_s: float = 30.0,
        checkpoint_s: float = 2.0,
        batch_s: float = 0.002,
        reconcile: Reconcile | None = None,
        close_batch_s: float = 0.1,
    ) -> None:
        """`batch_s`: how long the first open or close waits for others to share its transaction. A transaction
        costs ~0.3 ms of gateway CPU however few rows it writes (bench/metering.py), and the wait also keeps the
        open's write out of the few milliseconds in which the request's first token is relayed. `reconcile`: what a
        dead gateway's request had generated past its last checkpoint (Outbox.reap)."""
        if not 0 < checkpoint_s < lease_s:
            raise ValueError("need 0 < checkpoint_s < lease_s (a lease must outlive the renewal interval)")
        if not 0 <= batch_s <= close_batch_s < checkpoint_s:
            raise ValueError("need 0 <= batch_s <= close_batch_s < checkpoint_s")
        self.outbox, self.lease_s, self.checkpoint_s, self.batch_s = outbox, lease_s, checkpoint_s, batch_s
        self.close_batch_s, self.reconcile = close_batch_s, reconcile
        self.live: dict[str, Snapshot] = {}
        self.unsaved: dict[str, UsageEvent] = {}  # final events whose write failed, retried by `run`
        self._opens: dict[str, Snapshot] = {}  # requests whose open waits for the next batch
        self._closes: dict[str, UsageEvent] = {}  # final events waiting for the next batch
        self._due: float | None = None  # when the next batch must go (time.monotonic())
        self._nudge: asyncio.Future | None = None  # wakes the writer when the next batch is due sooner
        self._writer: asyncio.Task | None = None  # writes batches while there are any; one at a time
        self.outage = Outage("usage recorder: outbox database", log, checkpoint_s, 30.0)

    def started(self, request_id: str, snapshot: Snapshot) -> None:
        self.live[request_id] = snapshot
        self._opens[request_id] = snapshot
        self._queued(self.batch_s)

    def finished(self, event: UsageEvent) -> None:
        request_id = event.request_id
        running = self.live.pop(request_id, None) is not None
        unwritten = self._opens.pop(request_id, None) is not None  # its open not taken by a batch yet: dropped
        self._closes[request_id] = event
        # a running request whose open a batch took has its row open (or on the way): its close may wait for company;
        # else the close is the request's only write
        self._queued(self.close_batch_s if running and not unwritten else self.batch_s)

    def _queued(self, within_s: float) -> None:
        """A write queued that must go within `within_s`: the next batch goes then, or sooner."""
        due = time.monotonic() + within_s
        if self._due is None or due < self._due:
            self._due = due
            if self._nudge is not None and not self._nudge.done():
                self._nudge.set_result(None)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._write_batches())

    async def _write_batches(self) -> None:
        """Each batch when its earliest write is due, until none is left. A batch's opens are written before any later
        batch's closes, so a close never overtakes its open."""
        while self._opens or self._closes:
            await self._until_due()
            opens, self._opens = self._opens, {}
            closes, self._closes = self._closes, {}
            self._due = None
            await self._write([snapshot() for snapshot in opens.values()], list(closes.values()))

    async def _until_due(self) -> None:
        while self._due is not None and (wait_s := self._due - time.monotonic()) > 0:
            self._nudge = asyncio.get_running_loop().create_future()
            await asyncio.wait({self._nudge}, timeout=wait_s)
        self._nudge = None

    async def _write(self, opens: list[UsageEvent], closes: list[UsageEvent]) -> None:
        try:
            await self.outbox.write(opens, closes, self._lease_until())
        except BaseException as e:  # the closes are retried (a cancelled write may have landed: a retry is a no-op)
            self.unsaved.update((event.request_id, event) for event in closes)
            raise_if_cancelled(e)
            if not isinstance(e, Exception):
                raise
            log.warning(
                "usage outbox: could not write %d open(s) and %d close(s) (closes will be retried): %r",
                len(opens),
                len(closes),
                e,
            )

    async def run(self) -> None:
        """Renews the leases of running requests, retries failed closes, and closes rows whose gateway died."""
        while True:
            try:
                await self.tick()
            except Exception as e:  # never stops: the rows wait in the database, the finals in memory
                raise_if_cancelled(e)
                await asyncio.sleep(self.outage.failed(e))
                continue
            raise_if_cancelled()
            self.outage.recovered()
            await asyncio.sleep(self.checkpoint_s)

    async def tick(self) -> None:
        await self.outbox.checkpoint([snapshot() for snapshot in list(self.live.values())], self._lease_until())
        await self._retry_unsaved()
        reaped = await self.outbox.reap(reconcile=self.reconcile)
        if reaped:
            log.warning("usage outbox: closed %d request(s) left open by a gateway that stopped", reaped)

    async def _retry_unsaved(self) -> None:
        unsaved = dict(self.unsaved)
        if unsaved:
            await self.outbox.write([], list(unsaved.values()), self._lease_until())
            for request_id, event in unsaved.items():
                if self.unsaved.get(request_id) is event:
                    del self.unsaved[request_id]

    async def flush(self) -> None:
        """Writes what is queued and waits for it, then tries the failed closes once more (at shutdown)."""
        if self._opens or self._closes:
            self._queued(0.0)
        if self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)
        try:
            await self._retry_unsaved()
        except Exception as e:
            log.error(
                "usage outbox: %d final event(s) not saved at shutdown: %r (their rows close as failed later)",
                len(self.unsaved),
                e,
            )

    def _lease_until(self):
        return utcnow() + timedelta(seconds=self.lease_s)
