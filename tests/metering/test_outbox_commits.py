"""How the outbox's group commits commit, on SQLite and PostgreSQL: the opens and closes of one write in one
transaction (a failure leaves none of them), and a write that is one statement committed on its own, without a
transaction around it (SQLAlchemy's commit events are counted: none for it, one for a write of two statements)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import event as sa_event
from sqlalchemy import select

import tokenfleet.metering.outbox as outbox_module
from tests.metering.helpers import event, events
from tokenfleet.metering import Outbox
from tokenfleet.store.db import Database
from tokenfleet.store.models import UsageOutboxRow, utcnow

pytestmark = pytest.mark.anyio


async def stored(db: Database) -> dict[str, bool]:
    """request id -> whether its row is closed."""
    async with db.session() as session:
        rows = (await session.execute(select(UsageOutboxRow.request_id, UsageOutboxRow.lease_until))).all()
    return {request_id: lease is None for request_id, lease in rows}


def counted_commits(db: Database) -> list[int]:
    commits: list[int] = []
    sa_event.listen(db.engine.sync_engine, "commit", lambda _connection: commits.append(1))
    return commits


async def test_a_write_of_one_statement_commits_without_a_transaction(db: Database, outbox: Outbox):
    commits = counted_commits(db)
    lease = utcnow() + timedelta(seconds=30)
    await outbox.write(events(3), [], lease)  # opens only: one statement
    await outbox.write([], [event(0)], lease)  # closes only: one statement
    assert commits == []
    assert await stored(db) == {event(0).request_id: True, event(1).request_id: False, event(2).request_id: False}
    await outbox.write([event(5)], [event(1)], lease)  # both: one transaction, one commit
    assert commits == [1]
    assert (await stored(db))[event(5).request_id] is False and (await stored(db))[event(1).request_id] is True


async def test_opens_and_closes_of_one_write_commit_together(db: Database, outbox: Outbox, monkeypatch):
    original = outbox_module._close

    async def close_then_fail(connection, closing):
        await original(connection, closing)
        raise ConnectionError("the database went away after the close statement")

    monkeypatch.setattr(outbox_module, "_close", close_then_fail)
    with pytest.raises(ConnectionError):
        await outbox.write([event(1)], [event(2)], utcnow() + timedelta(seconds=30))
    assert await stored(db) == {}  # the open written before the failure was rolled back with it
