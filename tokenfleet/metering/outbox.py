"""The outbox: usage events written to the tenants' own SQL database at request end, one short transaction each,
so an outage of the event log loses nothing. The shipper moves them on; sent rows are purged after a while."""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import Sequence

from sqlalchemy import delete, func, select, update

from tokenfleet.metering.event import UsageEvent
from tokenfleet.metering.sql import insert_ignoring
from tokenfleet.store.db import Database
from tokenfleet.store.models import UsageEventRow, UsageOutboxRow, utcnow

OUTBOX = UsageOutboxRow.__table__


class Outbox:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def add(self, event: UsageEvent) -> bool:
        """Stores the event; False (and nothing written) when its request_id is already in the outbox."""
        row = {"request_id": event.request_id, "payload": event.to_json(), "created_at": utcnow(), "sent_at": None}
        async with self.db.session() as session, session.begin():
            return await insert_ignoring(session, OUTBOX, [row], key="request_id") == 1

    async def pending(self, limit: int = 500) -> list[tuple[int, UsageEvent]]:
        """The oldest events not yet shipped, with their row ids for `mark_sent`."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        query = (select(UsageOutboxRow.id, UsageOutboxRow.payload).where(UsageOutboxRow.sent_at.is_(None))
                 .order_by(UsageOutboxRow.id).limit(limit))
        async with self.db.session() as session:
            rows = (await session.execute(query)).all()
        return [(row_id, UsageEvent.from_json(payload)) for row_id, payload in rows]

    async def mark_sent(self, ids: Sequence[int]) -> None:
        if not ids:
            return
        statement = (update(UsageOutboxRow).where(UsageOutboxRow.id.in_(list(ids)), UsageOutboxRow.sent_at.is_(None))
                     .values(sent_at=utcnow()))
        async with self.db.session() as session, session.begin():
            await session.execute(statement)

    async def purge_sent(self, older_than: datetime | timedelta) -> int:
        """Deletes rows sent before `older_than` (a time, or an age such as timedelta(hours=1)); returns how many.
        A purged request_id could be added again, which is harmless: the warehouse keeps one row per request."""
        cutoff = utcnow() - older_than if isinstance(older_than, timedelta) else older_than
        statement = delete(UsageOutboxRow).where(UsageOutboxRow.sent_at.is_not(None), UsageOutboxRow.sent_at < cutoff)
        async with self.db.session() as session, session.begin():
            return (await session.execute(statement)).rowcount

    async def pending_count(self) -> int:
        query = select(func.count()).select_from(UsageOutboxRow).where(UsageOutboxRow.sent_at.is_(None))
        async with self.db.session() as session:
            return (await session.execute(query)).scalar_one()

    async def resend_unwritten(self) -> int:
        """Marks sent rows whose request has no warehouse row as pending again; returns how many. For start-up
        when the event log is in memory (embedded): events it held when the process died exist only here now."""
        written = select(UsageEventRow.request_id).where(UsageEventRow.request_id == UsageOutboxRow.request_id)
        statement = (update(UsageOutboxRow).where(UsageOutboxRow.sent_at.is_not(None), ~written.exists())
                     .values(sent_at=None))
        async with self.db.session() as session, session.begin():
            return (await session.execute(statement)).rowcount
