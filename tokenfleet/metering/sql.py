"""INSERT ... ON CONFLICT DO NOTHING for SQLite and PostgreSQL: how every metering write stays idempotent."""
from __future__ import annotations

from typing import Any, Sequence

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

# Rows per statement: 19 columns x 300 rows stays under PostgreSQL's 32767 bind parameters and SQLite's 32766.
CHUNK_ROWS = 300


async def insert_ignoring(session: AsyncSession, table: Table, rows: Sequence[dict[str, Any]],
                          key: str) -> int:
    """Inserts the rows whose `key` is not in the table yet; the others are skipped. Returns how many were new."""
    if not rows:
        return 0
    dialect = session.bind.dialect.name
    insert = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}.get(dialect)
    if insert is None:
        raise ValueError(f"unsupported database {dialect!r}: use sqlite or postgresql")
    added = 0
    for start in range(0, len(rows), CHUNK_ROWS):
        statement = insert(table).values(list(rows[start:start + CHUNK_ROWS]))
        result = await session.execute(statement.on_conflict_do_nothing(index_elements=[key]))
        added += max(result.rowcount, 0)
    return added
