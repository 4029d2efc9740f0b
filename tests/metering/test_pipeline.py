"""Outbox -> shipper -> log -> warehouse writer, on SQLite and PostgreSQL with a real Redis: every request ends up
as exactly one row through outages, crashes before ack, repeated publishes and restarts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import pytest

from tests.metering.helpers import Proxy, event, events, eventually, row_counts
from tokenfleet.metering import MemoryLog, Outbox, OutboxShipper, WarehouseWriter
from tokenfleet.store.db import Database
from tokenfleet.store.models import UsageEventRow

pytestmark = pytest.mark.anyio


async def drain(writer: WarehouseWriter) -> None:
    while await writer.drain_once(block_ms=0):
        pass


def assert_each_once(counts: dict[str, int], expected: Sequence) -> None:
    assert counts == {e.request_id: 1 for e in expected}


class CrashAfter:
    """Wraps a real log or outbox; the named call raises (after doing its work, when `after_work`) — a process
    dying at that point."""

    def __init__(self, target, method: str, after_work: bool = False) -> None:
        self.target, self.method, self.after_work = target, method, after_work

    def __getattr__(self, name: str):
        attr = getattr(self.target, name)
        if name != self.method:
            return attr

        async def crashing(*args, **kwargs):
            if self.after_work:
                await attr(*args, **kwargs)
            raise RuntimeError(f"crashed in {name}")

        return crashing


async def test_200_events_end_to_end_each_once(db: Database, outbox: Outbox, make_redis_log):
    for e in events(200):
        await outbox.add(e)
    shipper = OutboxShipper(outbox, make_redis_log(), batch=64)
    while await shipper.ship_once():
        pass
    assert await outbox.pending_count() == 0 and shipper.shipped == 200
    writer = WarehouseWriter(db, make_redis_log(), "writer-1", batch=50)
    await drain(writer)
    assert_each_once(await row_counts(db), events(200))
    assert writer.written == 200 and writer.duplicates == 0
    async with db.session() as session:
        row = await session.get(UsageEventRow, event(7).request_id)
    assert (row.org_id, row.input_tokens, row.cached_tokens, row.output_tokens) == ("org_1", 107, 7, 7)
    assert row.day == event(7).day and row.ended_at == event(7).ended_at and row.ttft_s == 0.05


async def test_running_loops_deliver_events_added_while_they_run(db: Database, outbox: Outbox, make_log):
    log = make_log()
    tasks = [
        asyncio.create_task(OutboxShipper(outbox, log, interval_s=0.02).run()),
        asyncio.create_task(WarehouseWriter(db, log, "w", block_ms=50).run()),
    ]
    try:
        for e in events(60):
            await outbox.add(e)
        await eventually(lambda: _rows_are(db, 60), what="60 warehouse rows")
    finally:
        await _stop(tasks)
    assert_each_once(await row_counts(db), events(60))


async def test_an_event_log_outage_loses_and_doubles_nothing(db: Database, outbox: Outbox, make_redis_log, caplog):
    proxy = Proxy()
    await proxy.start()
    shipper = OutboxShipper(outbox, make_redis_log(proxy.url), interval_s=0.02, max_backoff_s=0.2)
    writer = WarehouseWriter(db, make_redis_log(proxy.url), "w", block_ms=50, max_backoff_s=0.2)
    tasks = [asyncio.create_task(shipper.run()), asyncio.create_task(writer.run())]
    try:
        for e in events(30):
            await outbox.add(e)
        await eventually(lambda: _rows_are(db, 30), what="the first 30 rows")
        await proxy.stop()  # Redis unreachable: connections cut, new ones refused
        for e in events(70, first=30):
            await outbox.add(e)
        await asyncio.sleep(1.0)
        assert await outbox.pending_count() == 70 and len(await row_counts(db)) == 30
        assert not any(task.done() for task in tasks) and shipper.outage.ongoing
        await proxy.start()  # back on the same port
        await eventually(lambda: _rows_are(db, 100), what="all 100 rows after the outage")
    finally:
        await _stop(tasks)
        await proxy.stop()
    assert_each_once(await row_counts(db), events(100))
    assert await outbox.pending_count() == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("usage shipper" in w and "unavailable" in w for w in warnings) == 1  # once per outage
    assert sum("usage shipper" in w and "available again" in w for w in warnings) == 1


async def test_a_writer_that_dies_before_ack_is_replaced_and_nothing_doubles(db: Database, outbox: Outbox, make_log):
    log = make_log(claim_idle_ms=200)
    await log.publish(events(40))
    inserted_then_died = WarehouseWriter(db, CrashAfter(log, "ack"), "writer-a", batch=25)
    with pytest.raises(RuntimeError, match="crashed in ack"):
        await inserted_then_died.drain_once(block_ms=0)  # 25 rows written, not acked
    await log.read("writer-b", count=10, block_ms=0)  # read, never written nor acked: this one just dies
    survivor = WarehouseWriter(db, log, "writer-c")
    await drain(survivor)
    assert len(await row_counts(db)) == 30  # the 5 never read; the dead writers' entries are not idle long enough
    await asyncio.sleep(0.25)  # past the claim time
    await drain(survivor)
    assert_each_once(await row_counts(db), events(40))
    assert survivor.written == 15 and survivor.duplicates == 25
    await asyncio.sleep(0.25)
    assert await log.read("writer-d", count=100, block_ms=0) == []  # everything acked


async def test_a_shipper_crash_between_publish_and_mark_sent_publishes_twice_but_writes_once(
    db: Database, outbox: Outbox, make_log
):
    log = make_log()
    for e in events(20):
        await outbox.add(e)
    with pytest.raises(RuntimeError, match="crashed in mark_sent"):
        await OutboxShipper(CrashAfter(outbox, "mark_sent"), log).ship_once()
    assert await outbox.pending_count() == 20  # published, but the outbox does not know
    restarted = OutboxShipper(outbox, log)
    assert await restarted.ship_once() == 20  # all twenty again
    writer = WarehouseWriter(db, log, "w", batch=15)
    await drain(writer)
    assert_each_once(await row_counts(db), events(20))
    assert writer.written == 20 and writer.duplicates == 20


async def test_a_batch_whose_insert_failed_is_retried_not_lost(db: Database, outbox: Outbox, make_log):
    log = make_log(claim_idle_ms=60_000)  # recovery must not depend on a claim
    await log.publish(events(10))
    writer = WarehouseWriter(db, log, "w")
    real_db, writer.db = writer.db, Database("postgresql://127.0.0.1:1/down")  # the database is unreachable
    with pytest.raises(OSError):
        await writer.drain_once(block_ms=0)
    await writer.db.close()
    writer.db = real_db
    assert await writer.drain_once(block_ms=0) == 10
    assert_each_once(await row_counts(db), events(10))


async def test_embedded_restart_resends_what_the_memory_log_held(db: Database, outbox: Outbox):
    """kill -9 with an in-memory log: the outbox rows say "sent" but only 10 of 30 reached the warehouse."""
    for e in events(30):
        await outbox.add(e)
    log = MemoryLog()
    await OutboxShipper(outbox, log).ship_once()
    await WarehouseWriter(db, log, "w", batch=10).drain_once(block_ms=0)
    fresh_log = MemoryLog()  # the process started again
    assert await outbox.resend_unwritten() == 20
    await OutboxShipper(outbox, fresh_log).ship_once()
    await drain(WarehouseWriter(db, fresh_log, "w"))
    assert_each_once(await row_counts(db), events(30))


async def _rows_are(db: Database, count: int) -> bool:
    return len(await row_counts(db)) == count


async def _stop(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results  # nothing raised on its own
