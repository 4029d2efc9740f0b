"""The outbox: usage events in the tenants' own SQL database, so an outage of the event log loses nothing.

A request's row is opened when it starts, with a lease its gateway keeps renewing (and its counts so far), and
closed with the final event when it ends; only closed rows are shipped. A row whose lease ran out belongs to a
gateway that died mid-request: `reap` closes it as failed with its last counts, so even a `kill -9` leaves one
event per request. The shipper moves closed rows on; sent rows are purged after a while, once the warehouse has
them (until then they may be sent again)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime, timedelta

from sqlalchemy import and_, bindparam, delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from tokenfleet.metering.event import UsageEvent
from tokenfleet.metering.log import log
from tokenfleet.metering.sql import CHUNK_ROWS, insert_ignoring, upsert_where
from tokenfleet.store.db import Database
from tokenfleet.store.models import UsageEventRow, UsageOutboxRow, utcnow

OUTBOX = UsageOutboxRow.__table__
STILL_OPEN = OUTBOX.c.lease_until.is_not(None)
# the rule of every outbox write, opens and closes alike: a new row is inserted; an open row takes a close (its final
# event); nothing else changes a row (a second open, or anything after the close). Built once: part of the cached
# statement's key
CLOSING_AN_OPEN_ROW = and_(STILL_OPEN, OUTBOX.alias("excluded").c.lease_until.is_(None))
# the row's event is in the warehouse (correlated with the outbox row of the statement it is used in)
WRITTEN = select(UsageEventRow.request_id).where(UsageEventRow.request_id == UsageOutboxRow.request_id)
Reconcile = Callable[[UsageEvent], Awaitable[UsageEvent]]
CHECKPOINT = (
    OUTBOX.update()
    .where(OUTBOX.c.request_id == bindparam("rid"), STILL_OPEN)
    .values(payload=bindparam("body"), lease_until=bindparam("until"))
)


class Outbox:
    def __init__(self, db: Database) -> None:
        self.db = db
        self._held: AsyncConnection | None = None  # the autocommit connection of `write`, kept open
        self._holding = asyncio.Lock()  # one write on it at a time

    @contextlib.asynccontextmanager
    async def _writing(self, statements: int, held: bool = False) -> AsyncIterator[AsyncConnection]:
        """A connection for `statements` writes that commit together: in a transaction when there are several; one
        statement commits on its own (autocommit), the same one commit without the BEGIN and COMMIT round trips,
        which cost the gateway about a third of a one-row write's CPU (bench/gateway_capacity.py). `held`: on the
        connection kept open for the recorder's group commits (`write`), not one taken from the pool and given back,
        which costs about as much again (docs/benchmarks/gateway_capacity.md, round 6); `aclose` gives it back."""
        if statements > 1:
            async with self.db.engine.begin() as connection:
                yield connection
        elif not held:
            async with self.db.engine.connect() as connection:
                yield await connection.execution_options(isolation_level="AUTOCOMMIT")
        else:
            async with self._holding:
                connection = self._held
                if connection is None:
                    connection = await self.db.engine.connect()
                    self._held = connection = await connection.execution_options(isolation_level="AUTOCOMMIT")
                try:
                    yield connection
                except BaseException:  # it may be broken (the database restarted): the next write takes a new one
                    self._held = None
                    with contextlib.suppress(Exception):
                        await connection.invalidate()
                    raise

    async def aclose(self) -> None:
        """Gives back the connection kept for `write` (at shutdown; a later write takes a new one)."""
        async with self._holding:
            connection, self._held = self._held, None
            if connection is not None:
                await connection.close()

    async def add(self, event: UsageEvent) -> bool:
        """Stores the event; False (and nothing written) when its request_id is already in the outbox."""
        async with self._writing(1) as connection:
            return await insert_ignoring(connection, OUTBOX, [_row(event, None)], key="request_id") == 1

    async def open(self, event: UsageEvent, lease_until: datetime) -> bool:
        """Opens the request's row with its provisional event; False when the request already has a row."""
        async with self._writing(1) as connection:
            return await _record(connection, [_row(event, lease_until)]) == 1

    async def checkpoint(self, events: Sequence[UsageEvent], lease_until: datetime) -> None:
        """Renews the leases of open rows and stores their counts so far (one statement for all of them)."""
        if not events:
            return
        params = [{"rid": e.request_id, "body": e.to_json(), "until": lease_until} for e in events]
        async with self._writing(1) as connection:
            await connection.execute(CHECKPOINT, params)

    async def close(self, event: UsageEvent) -> bool:
        """Stores the final event and makes it shippable. False when the row was already closed (by a reaper that
        thought this gateway dead, or an earlier close): the first final word stands."""
        async with self._writing(1) as connection:
            return await _record(connection, [_row(event, None)]) == 1

    async def write(self, opens: Sequence[UsageEvent], closes: Sequence[UsageEvent], lease_until: datetime) -> None:
        """Opens and closes of many requests at once, as `open` and `close` each would (the recorder's group commit):
        one statement (so no transaction around it) up to CHUNK_ROWS rows, one transaction beyond. A request in both
        is only closed."""
        finals = {e.request_id: _row(e, None) for e in closes}  # a statement can change a row only once
        rows = [_row(e, lease_until) for e in opens if e.request_id not in finals] + list(finals.values())
        if not rows:
            return
        async with self._writing(-(-len(rows) // CHUNK_ROWS), held=True) as connection:
            await _record(connection, rows)

    async def reap(
        self,
        now: datetime | None = None,
        reconcile: Reconcile | None = None,
        reconcile_for: timedelta = timedelta(minutes=5),
    ) -> int:
        """Closes rows whose lease ran out (their gateway died) as failed, with their last counts, or with what
        `reconcile` finds was generated (counts after the last checkpoint). A row `reconcile` fails on is left
        for the next call, until its lease ran out `reconcile_for` ago. Returns how many this call closed; several
        gateways may reap at once, each row is closed by one of them."""
        now = now or utcnow()
        expired = (
            select(UsageOutboxRow.request_id, UsageOutboxRow.payload, UsageOutboxRow.lease_until)
            .where(UsageOutboxRow.lease_until < now)
            .limit(500)
        )
        async with self.db.session() as session:
            rows = (await session.execute(expired)).all()
        finals = []
        for request_id, payload, lease_until in rows:
            final = dataclasses.replace(UsageEvent.from_json(payload), status="failed")
            if reconcile is not None:
                try:
                    final = await reconcile(final)
                except Exception as e:
                    if now - lease_until < reconcile_for:
                        log.warning("usage outbox: cannot reconcile %s yet (%r); retrying", request_id, e)
                        continue
                    log.error("usage outbox: closing %s with its last checkpoint: %r", request_id, e)
            finals.append(final)
        closed = 0
        async with self.db.session() as session, session.begin():
            for final in finals:
                statement = (
                    update(UsageOutboxRow)
                    .where(UsageOutboxRow.request_id == final.request_id, UsageOutboxRow.lease_until < now)
                    .values(payload=final.to_json(), lease_until=None)
                )
                closed += (await session.execute(statement)).rowcount
        return closed

    async def pending(self, limit: int = 500) -> list[tuple[int, UsageEvent]]:
        """The oldest events not yet shipped, with their row ids for `mark_sent`."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        query = (
            select(UsageOutboxRow.id, UsageOutboxRow.payload)
            .where(UsageOutboxRow.sent_at.is_(None), UsageOutboxRow.lease_until.is_(None))
            .order_by(UsageOutboxRow.id)
            .limit(limit)
        )
        async with self.db.session() as session:
            rows = (await session.execute(query)).all()
        return [(row_id, UsageEvent.from_json(payload)) for row_id, payload in rows]

    async def mark_sent(self, ids: Sequence[int]) -> None:
        if not ids:
            return
        statement = (
            update(UsageOutboxRow)
            .where(UsageOutboxRow.id.in_(list(ids)), UsageOutboxRow.sent_at.is_(None))
            .values(sent_at=utcnow())
        )
        async with self.db.session() as session, session.begin():
            await session.execute(statement)

    async def purge_sent(self, older_than: datetime | timedelta) -> int:
        """Deletes rows sent before `older_than` (a time, or an age such as timedelta(hours=1)) whose event is in the
        warehouse; returns how many. Rows the warehouse does not have yet stay, to be sent again
        (`resend_unwritten`): the event log may have lost them."""
        cutoff = utcnow() - older_than if isinstance(older_than, timedelta) else older_than
        statement = delete(UsageOutboxRow).where(
            UsageOutboxRow.sent_at.is_not(None), UsageOutboxRow.sent_at < cutoff, WRITTEN.exists()
        )
        async with self.db.session() as session, session.begin():
            return (await session.execute(statement)).rowcount

    async def pending_count(self) -> int:
        query = (
            select(func.count())
            .select_from(UsageOutboxRow)
            .where(UsageOutboxRow.sent_at.is_(None), UsageOutboxRow.lease_until.is_(None))
        )
        async with self.db.session() as session:
            return (await session.execute(query)).scalar_one()

    async def resend_unwritten(self, older_than: datetime | timedelta | None = None) -> int:
        """Marks sent rows whose request has no warehouse row as pending again; returns how many. At start-up when
        the event log is in memory (embedded): events it held when the process died exist only here now; and, for
        rows sent before `older_than` (a time, or an age), in a fleet: the Redis Stream may have lost
        them (a restart without persistence, MAXLEN). The warehouse writer skips any already written."""
        statement = update(UsageOutboxRow).where(UsageOutboxRow.sent_at.is_not(None), ~WRITTEN.exists())
        if older_than is not None:
            cutoff = utcnow() - older_than if isinstance(older_than, timedelta) else older_than
            statement = statement.where(UsageOutboxRow.sent_at < cutoff)
        async with self.db.session() as session, session.begin():
            return (await session.execute(statement.values(sent_at=None))).rowcount


def _row(event: UsageEvent, lease_until: datetime | None) -> dict:
    return {
        "request_id": event.request_id,
        "payload": event.to_json(),
        "created_at": utcnow(),
        "sent_at": None,
        "lease_until": lease_until,
    }


async def _record(connection: AsyncConnection, rows: list[dict]) -> int:
    """Open rows (a lease) and closed ones (none), by the rule of CLOSING_AN_OPEN_ROW, in one upsert per CHUNK_ROWS
    rows: a new request's row is inserted, open or closed; an open row takes its final event; a second open, or
    anything once a row is closed, changes nothing. Returns how many rows it inserted or closed. At most one row per
    request (a statement changes a row once)."""
    return await upsert_where(
        connection, OUTBOX, rows, key="request_id", update=("payload", "lease_until"), only_if=CLOSING_AN_OPEN_ROW
    )
