"""The outbox on SQLite and PostgreSQL: add is idempotent per request, pending is oldest first, mark_sent and
purge_sent, and resending what the warehouse never got."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from tests.metering.helpers import event, events
from tokenfleet.metering import Outbox
from tokenfleet.metering.sql import insert_ignoring
from tokenfleet.metering.warehouse import WAREHOUSE, warehouse_row
from tokenfleet.store.db import Database
from tokenfleet.store.models import UsageOutboxRow, utcnow

pytestmark = pytest.mark.anyio


async def outbox_rows(db: Database) -> int:
    async with db.session() as session:
        return (await session.execute(select(func.count()).select_from(UsageOutboxRow))).scalar_one()


async def test_add_is_idempotent_on_request_id(db: Database, outbox: Outbox):
    assert await outbox.add(event(1)) is True
    assert await outbox.add(event(1)) is False
    assert await outbox.add(event(1, output_tokens=999)) is False  # the first write of a request wins
    assert await outbox_rows(db) == 1
    [(_, stored)] = await outbox.pending()
    assert stored == event(1)


async def test_concurrent_adds_of_one_request_write_one_row(db: Database, outbox: Outbox):
    added = await asyncio.gather(*(outbox.add(event(3)) for _ in range(10)))
    assert added.count(True) == 1 and await outbox_rows(db) == 1


async def test_pending_is_oldest_first_and_limited(outbox: Outbox):
    for e in events(5):
        await outbox.add(e)
    first = await outbox.pending(3)
    assert [e.request_id for _, e in first] == [e.request_id for e in events(3)]
    assert [row_id for row_id, _ in first] == sorted(row_id for row_id, _ in first)
    assert len(await outbox.pending(100)) == 5
    with pytest.raises(ValueError, match="limit must be at least 1"):
        await outbox.pending(0)


async def test_mark_sent_takes_rows_out_of_pending(outbox: Outbox):
    for e in events(4):
        await outbox.add(e)
    pending = await outbox.pending()
    await outbox.mark_sent([row_id for row_id, _ in pending[:3]])
    await outbox.mark_sent([])
    assert [e for _, e in await outbox.pending()] == [pending[3][1]]
    assert await outbox.pending_count() == 1
    assert await outbox.add(pending[0][1]) is False  # sent, but still there: still idempotent


async def test_purge_deletes_only_rows_sent_before_the_cutoff_and_written(db: Database, outbox: Outbox):
    for e in events(3):
        await outbox.add(e)
    pending = await outbox.pending()
    await outbox.mark_sent([pending[0][0], pending[1][0]])
    async with db.session() as session, session.begin():  # only the first made it to the warehouse
        await insert_ignoring(session, WAREHOUSE, [warehouse_row(events(1)[0])], key="request_id")
    assert await outbox.purge_sent(timedelta(hours=1)) == 0  # sent just now: kept
    assert await outbox.purge_sent(utcnow() + timedelta(seconds=1)) == 1  # a cutoff time works too
    assert await outbox_rows(db) == 2 and await outbox.pending_count() == 1  # unsent rows are never purged
    assert await outbox.resend_unwritten() == 1  # sent but never written: kept, and can be sent again


async def test_resend_unwritten_requeues_sent_rows_without_a_warehouse_row(db: Database, outbox: Outbox):
    for e in events(4):
        await outbox.add(e)
    await outbox.mark_sent([row_id for row_id, _ in await outbox.pending()])
    async with db.session() as session, session.begin():  # two made it to the warehouse, two were lost in transit
        await insert_ignoring(session, WAREHOUSE, [warehouse_row(e) for e in events(2)], key="request_id")
    assert await outbox.resend_unwritten() == 2
    assert [e.request_id for _, e in await outbox.pending()] == [e.request_id for e in events(2, first=2)]
    assert await outbox.resend_unwritten() == 0  # pending rows are left alone


async def test_resend_unwritten_can_take_only_rows_sent_before_a_time(db: Database, outbox: Outbox):
    for e in events(2):
        await outbox.add(e)
    await outbox.mark_sent([row_id for row_id, _ in await outbox.pending()])
    assert await outbox.resend_unwritten(timedelta(minutes=1)) == 0  # sent just now: the writer may be on it
    assert await outbox.resend_unwritten(utcnow() + timedelta(seconds=1)) == 2


async def test_an_open_row_is_not_shipped_until_closed(outbox: Outbox):
    lease = utcnow() + timedelta(seconds=30)
    assert await outbox.open(event(7, output_tokens=0), lease) is True
    assert await outbox.open(event(7, output_tokens=3), lease) is False  # a second open changes nothing
    assert await outbox.pending() == [] and await outbox.pending_count() == 0
    await outbox.checkpoint([event(7, output_tokens=4)], lease)
    assert await outbox.pending() == []
    assert await outbox.close(event(7, output_tokens=9)) is True
    [(_, final)] = await outbox.pending()
    assert final.output_tokens == 9 and final.status == "finished"
    assert await outbox.close(event(7, output_tokens=11)) is False  # the first final word stands


async def test_a_row_whose_lease_ran_out_is_reaped_once_as_failed_with_its_last_counts(outbox: Outbox):
    await outbox.open(event(8, output_tokens=0), utcnow() + timedelta(seconds=30))
    await outbox.checkpoint([event(8, output_tokens=5)], utcnow() - timedelta(seconds=1))  # its gateway died
    await outbox.open(event(9), utcnow() + timedelta(seconds=30))  # alive
    reaped = await asyncio.gather(outbox.reap(), outbox.reap())
    assert sum(reaped) == 1
    [(_, final)] = await outbox.pending()
    assert (final.request_id, final.status, final.output_tokens) == (event(8).request_id, "failed", 5)
    assert await outbox.close(event(8)) is False  # the gateway was only slow: the reaped event stands


async def test_the_reaper_bills_what_reconcile_finds_and_retries_a_row_it_fails_on(outbox: Outbox):
    await outbox.open(event(11, output_tokens=0), utcnow() - timedelta(seconds=1))
    await outbox.open(event(12, output_tokens=0), utcnow() - timedelta(seconds=1))

    async def reconcile(e):
        if e.request_id == event(12).request_id:
            raise ConnectionError("redis is down")
        return dataclasses.replace(e, output_tokens=40)

    assert await outbox.reap(reconcile=reconcile) == 1
    [(_, final)] = await outbox.pending()
    assert (final.request_id, final.status, final.output_tokens) == (event(11).request_id, "failed", 40)
    assert await outbox.reap(reconcile=reconcile, reconcile_for=timedelta(0)) == 1  # gave up: its checkpoint
    assert [e.output_tokens for _, e in await outbox.pending()] == [40, 0]


async def test_a_close_without_an_open_row_writes_the_event(outbox: Outbox):
    assert await outbox.close(event(10)) is True
    assert [e.request_id for _, e in await outbox.pending()] == [event(10).request_id]


async def test_write_opens_and_closes_many_requests_in_one_go(outbox: Outbox):
    lease = utcnow() + timedelta(seconds=30)
    await outbox.open(event(20, output_tokens=1), lease)  # opened by an earlier batch
    await outbox.write(
        [event(21, output_tokens=0), event(22, output_tokens=0)],
        [event(20, output_tokens=7), event(22, output_tokens=3), event(23)],
        lease,
    )
    closed = {e.request_id: e.output_tokens for _, e in await outbox.pending()}
    assert closed == {event(20).request_id: 7, event(22).request_id: 3, event(23).request_id: 23}  # 21 still runs
    await outbox.write([event(20, output_tokens=0)], [event(22, output_tokens=99)], lease)  # late open, second close
    await outbox.checkpoint([event(21, output_tokens=4)], lease)
    assert {e.request_id: e.output_tokens for _, e in await outbox.pending()} == closed  # the first final word stands
    await outbox.write([], [event(21, output_tokens=5)], lease)
    assert {e.request_id: e.output_tokens for _, e in await outbox.pending()} == {**closed, event(21).request_id: 5}
