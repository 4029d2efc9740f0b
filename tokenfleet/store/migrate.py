"""Schema migrations with Alembic, run from code: no alembic.ini is needed, the Config is built here.

To write the next migration, add `migrations/versions/NNNN_what.py` by hand (copy 0001) or let Alembic draft it
from the models against an up-to-date database:

    python -c "from alembic import command; from tokenfleet.store.migrate import alembic_config; \
command.revision(alembic_config(url='sqlite:///dev.db'), 'usage', autogenerate=True, rev_id='0002')"
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, text
from sqlalchemy.ext.asyncio import AsyncEngine

MIGRATIONS = Path(__file__).with_name("migrations")
# Gateways starting together on one PostgreSQL take turns; any fixed 64-bit number works as the lock's name.
PG_LOCK_ID = 0x746F6B656E666C74


def alembic_config(connection: Connection | None = None, url: str | None = None) -> Config:
    """`connection`: migrate over this open connection (what `upgrade` does); else env.py connects to `url`."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    if url:
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes["connection"] = connection
    return config


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    async with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            await conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": PG_LOCK_ID})
        await conn.run_sync(lambda sync_conn: command.upgrade(alembic_config(sync_conn), revision))


async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(lambda sync_conn: MigrationContext.configure(sync_conn).get_current_revision())


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()
