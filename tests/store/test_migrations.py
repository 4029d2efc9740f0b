"""Migrations: to head from nothing, again as a no-op, and the result is exactly the ORM models' schema."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from tokenfleet.store.db import Database, migrate
from tokenfleet.store.migrate import current_revision, head_revision
from tokenfleet.store.models import Base

pytestmark = pytest.mark.anyio


def schema(sync_conn) -> dict:
    inspector = inspect(sync_conn)
    return {
        table: (
            [c["name"] for c in inspector.get_columns(table)],
            sorted(str(u["column_names"]) for u in inspector.get_unique_constraints(table)),
        )
        for table in sorted(inspector.get_table_names())
    }


async def test_migrate_reaches_head_and_twice_is_a_no_op(db: Database):
    assert await current_revision(db.engine) == head_revision() == "0004"
    async with db.engine.connect() as conn:
        before = await conn.run_sync(schema)
    await db.migrate()
    await migrate(db.url.render_as_string(hide_password=False))  # the module-level entry point, from a URL
    async with db.engine.connect() as conn:
        assert await conn.run_sync(schema) == before
        assert (await conn.execute(text("SELECT count(*) FROM alembic_version"))).scalar() == 1
    assert {"organisations", "users", "api_keys"} <= set(before)


async def test_migrations_create_exactly_the_models(db: Database):
    """Drift between models.py and migrations/versions would show here as a diff."""
    async with db.engine.connect() as conn:
        diff = await conn.run_sync(lambda c: compare_metadata(MigrationContext.configure(c), Base.metadata))
    assert diff == []


async def test_sqlite_runs_with_wal_and_foreign_keys(tmp_path):
    async with Database(f"sqlite:///{tmp_path}/nested/folder/x.db") as db:  # the folder is created
        async with db.engine.connect() as conn:
            assert (await conn.execute(text("PRAGMA journal_mode"))).scalar() == "wal"
            assert (await conn.execute(text("PRAGMA foreign_keys"))).scalar() == 1


async def test_in_memory_sqlite_keeps_one_database():
    """sqlite:///:memory: is one shared connection, so the migrated tables are there for later sessions."""
    from tokenfleet.store.tenants import TenantStore

    async with Database("sqlite:///:memory:") as db:
        await db.migrate()
        store = TenantStore(db)
        _, plaintext = await store.create_key("acme", "alice")
        assert (await store.authenticate(plaintext)).org_name == "acme"
