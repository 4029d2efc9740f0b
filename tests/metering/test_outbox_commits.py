"""How the outbox's group commits commit, on SQLite and PostgreSQL: the opens and closes of one write are one
statement, committed on its own without a transaction around it (SQLAlchemy's commit events are counted: none for
it); a write of more rows than one statement takes is one transaction (one commit; a failure leaves none of them)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import event as sa_event
from sqlalchemy import select

import tokenfleet.metering.outbox as outbox_module
import tokenfleet.metering.sql as sql_module
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
    await outbox.write(events(3), [], lease)  # opens only
    await outbox.write([], [event(0)], lease)  # closes only
    await outbox.write([event(5)], [event(1)], lease)  # both: still one statement
    assert commits == []
    assert await stored(db) == {
        event(0).request_id: True,
        event(1).request_id: True,
        event(2).request_id: False,
        event(5).request_id: False,
    }


async def test_a_write_of_several_statements_commits_once(db: Database, outbox: Outbox, monkeypatch):
    monkeypatch.setattr(outbox_module, "CHUNK_ROWS", 2)
    monkeypatch.setattr(sql_module, "CHUNK_ROWS", 2)
    commits = counted_commits(db)
    await outbox.write(events(2), [event(2)], utcnow() + timedelta(seconds=30))  # three rows: two statements
    assert commits == [1]
    assert await stored(db) == {event(0).request_id: False, event(1).request_id: False, event(2).request_id: True}


async def test_the_statements_of_one_write_commit_together(db: Database, outbox: Outbox, monkeypatch):
    monkeypatch.setattr(outbox_module, "CHUNK_ROWS", 2)
    monkeypatch.setattr(sql_module, "CHUNK_ROWS", 2)
    original = outbox_module.upsert_where

    async def write_then_fail(*args, **kwargs):
        await original(*args, **kwargs)
        raise ConnectionError("the database went away after the statements")

    monkeypatch.setattr(outbox_module, "upsert_where", write_then_fail)
    with pytest.raises(ConnectionError):
        await outbox.write([event(1)], [event(2), event(3)], utcnow() + timedelta(seconds=30))
    assert await stored(db) == {}  # the statements written before the failure were rolled back with it


async def test_group_commits_share_one_connection_and_a_broken_one_is_replaced(db: Database, outbox: Outbox):
    checkouts: list[int] = []
    sa_event.listen(db.engine.sync_engine, "checkout", lambda *_: checkouts.append(1))
    lease = utcnow() + timedelta(seconds=30)
    for i in range(5):
        await outbox.write([event(i)], [], lease)
    assert len(checkouts) == 1  # taken once, kept for the next writes
    if db.is_sqlite:
        return
    async with db.engine.connect() as other:  # the database drops it (a restart, a failover, an idle timeout)
        await other.exec_driver_sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'idle'"
        )
    before = len(checkouts)
    with pytest.raises(Exception):  # noqa: B017 - whatever the driver raises for a dead connection
        await outbox.write([event(10)], [], lease)
    await outbox.write([event(11)], [event(10)], lease)  # the recorder's retry: on a new connection
    assert len(checkouts) == before + 1
    assert (await stored(db))[event(10).request_id] is True and (await stored(db))[event(11).request_id] is False
