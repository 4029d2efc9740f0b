"""insert_ignoring on SQLite and PostgreSQL: exact counts of new rows, and a statement compiled once and reused
whatever the rows (the warehouse writer's batches and every outbox write go through it)."""

from __future__ import annotations

import pytest
from sqlalchemy import event as sql_event

from tests.metering.helpers import events
from tokenfleet.metering.sql import CHUNK_ROWS, insert_ignoring
from tokenfleet.metering.warehouse import WAREHOUSE, warehouse_row
from tokenfleet.store.db import Database

pytestmark = pytest.mark.anyio


async def insert(db: Database, first: int, count: int) -> int:
    async with db.session() as session, session.begin():
        return await insert_ignoring(
            session, WAREHOUSE, [warehouse_row(e) for e in events(count, first)], key="request_id"
        )


async def test_counts_only_new_rows_across_chunks_and_calls(db: Database):
    assert await insert(db, 0, 2 * CHUNK_ROWS + 5) == 2 * CHUNK_ROWS + 5
    assert await insert(db, CHUNK_ROWS, 2 * CHUNK_ROWS) == CHUNK_ROWS - 5  # overlaps the first call
    assert await insert(db, 7, 1) == 0
    async with db.session() as session, session.begin():
        rows = [warehouse_row(e) for e in events(2, 5000)]
        assert await insert_ignoring(session, WAREHOUSE, rows + rows[:1], key="request_id") == 2  # repeated in a call


async def test_the_statement_is_compiled_once_and_reused(db: Database):
    compiled = []

    def seen(conn, cursor, statement, parameters, context, executemany) -> None:
        compiled.append(context.compiled)

    sql_event.listen(db.engine.sync_engine, "before_cursor_execute", seen)
    try:
        for first, count in ((0, 1), (1, 1), (2, 40), (42, 3)):
            await insert(db, first, count)
    finally:
        sql_event.remove(db.engine.sync_engine, "before_cursor_execute", seen)
    one_row, many_rows = compiled[:2], compiled[2:]  # SQLAlchemy compiles an executemany apart from an execute
    assert len(compiled) == 4 and one_row[0] is one_row[1] and many_rows[0] is many_rows[1]
