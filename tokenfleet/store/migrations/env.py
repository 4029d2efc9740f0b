"""Alembic's environment for tokenfleet's schema. `tokenfleet.store.migrate.upgrade` hands in an open connection
(config.attributes["connection"]); otherwise this connects to sqlalchemy.url with the async engine itself."""

import asyncio

from alembic import context
from sqlalchemy import Connection

from tokenfleet.store.db import Database, default_database_url
from tokenfleet.store.models import Base

config = context.config


def run_on(connection: Connection) -> None:
    # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
    context.configure(
        connection=connection, target_metadata=Base.metadata, render_as_batch=connection.dialect.name == "sqlite"
    )
    with context.begin_transaction():
        context.run_migrations()


async def run_connected() -> None:
    db = Database(config.get_main_option("sqlalchemy.url") or default_database_url())
    try:
        async with db.engine.connect() as connection:
            await connection.run_sync(run_on)
            await connection.commit()
    finally:
        await db.close()


def run_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=Base.metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
elif config.attributes.get("connection") is not None:
    run_on(config.attributes["connection"])
else:
    asyncio.run(run_connected())
