"""The gateway's side of metering: every request's row in the outbox, opened when it starts, kept alive while it
runs and closed with the final event when it ends. No write is on a request's path: they run in the background,
and a write that fails (the database is down) is kept in memory and retried until it lands."""
from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Callable

from tokenfleet.metering.event import UsageEvent
from tokenfleet.metering.log import log
from tokenfleet.metering.outage import Outage, raise_if_cancelled
from tokenfleet.metering.outbox import Outbox
from tokenfleet.store.models import utcnow

Snapshot = Callable[[], UsageEvent]  # the request's event as of now (counts so far)


class UsageRecorder:
    def __init__(self, outbox: Outbox, lease_s: float = 30.0, checkpoint_s: float = 2.0, max_writes: int = 4) -> None:
        """`max_writes`: opens and closes in flight at once; the others wait their turn. More than the database
        pool keeps (5) made a burst of requests open and close a connection per write: on PostgreSQL ~180 new
        connections per 1000 events and a third more CPU per event than waiting (bench/metering.py)."""
        if not 0 < checkpoint_s < lease_s:
            raise ValueError("need 0 < checkpoint_s < lease_s (a lease must outlive the renewal interval)")
        if max_writes < 1:
            raise ValueError("max_writes must be at least 1")
        self.outbox, self.lease_s, self.checkpoint_s = outbox, lease_s, checkpoint_s
        self._writing = asyncio.Semaphore(max_writes)
        self.live: dict[str, Snapshot] = {}
        self.unsaved: dict[str, UsageEvent] = {}  # final events whose close failed, retried by `run`
        self._opening: dict[str, asyncio.Task] = {}
        self._queued_opens: set[str] = set()  # opens still waiting for their turn to write
        self._tasks: set[asyncio.Task] = set()
        self.outage = Outage("usage recorder: outbox database", log, checkpoint_s, 30.0)

    def started(self, request_id: str, snapshot: Snapshot) -> None:
        self.live[request_id] = snapshot
        self._queued_opens.add(request_id)
        self._opening[request_id] = self._spawn(self._open(snapshot()))

    def finished(self, event: UsageEvent) -> None:
        self.live.pop(event.request_id, None)
        opening = self._opening.pop(event.request_id, None)
        if event.request_id in self._queued_opens:
            # Its open never got a turn to write (a backlog): the close inserts the row alone, one write instead
            # of two, and closes do not wait behind the opens of newer requests.
            self._queued_opens.discard(event.request_id)
            opening.cancel()
            opening = None
        self._spawn(self._close(event, opening))

    async def _open(self, event: UsageEvent) -> None:
        try:
            async with self._writing:
                self._queued_opens.discard(event.request_id)
                await self.outbox.open(event, self._lease_until())
        except Exception as e:  # the close (or its retries) still writes the row
            raise_if_cancelled(e)
            log.warning("usage outbox: could not open %s: %r", event.request_id, e)

    async def _close(self, event: UsageEvent, opening: asyncio.Task | None) -> None:
        if opening is not None:
            await asyncio.gather(opening, return_exceptions=True)  # the close must not overtake the open
        try:
            async with self._writing:
                await self.outbox.close(event)
        except Exception as e:
            raise_if_cancelled(e)
            log.warning("usage outbox: could not close %s (will retry): %r", event.request_id, e)
            self.unsaved[event.request_id] = event

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
        for request_id, event in list(self.unsaved.items()):
            await self.outbox.close(event)
            del self.unsaved[request_id]
        reaped = await self.outbox.reap()
        if reaped:
            log.warning("usage outbox: closed %d request(s) left open by a gateway that stopped", reaped)

    async def flush(self) -> None:
        """Waits for the writes in flight, then tries the failed ones once more (at shutdown)."""
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for request_id, event in list(self.unsaved.items()):
            try:
                await self.outbox.close(event)
                del self.unsaved[request_id]
            except Exception as e:
                log.error("usage outbox: %s not saved at shutdown: %r (its row closes as failed later)",
                          request_id, e)

    def _lease_until(self):
        return utcnow() + timedelta(seconds=self.lease_s)

    def _spawn(self, work) -> asyncio.Task:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
