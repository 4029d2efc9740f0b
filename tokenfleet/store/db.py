"""The database connection: an async engine and session factory from one URL, SQLite or PostgreSQL."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

ENV_VAR = "TOKENFLEET_DATABASE_URL"
DEFAULT_PATH = "~/.local/share/tokenfleet/tokenfleet.db"
ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg", "postgres": "postgresql+asyncpg"}


def default_database_url() -> str:
    """$TOKENFLEET_DATABASE_URL, else the embedded SQLite file under ~/.local/share/tokenfleet (its folder is
    created)."""
    if os.environ.get(ENV_VAR):
        return os.environ[ENV_VAR]
    path = Path(DEFAULT_PATH).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def async_url(url: str) -> URL:
    """The URL with its async driver: sqlite:/// → sqlite+aiosqlite:///, postgresql:// → postgresql+asyncpg://."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ValueError(
            f"not a database URL: {url!r} (try sqlite:///path/to/file.db or postgresql://user@host/db)"
        ) from None
    backend, _, driver = parsed.drivername.partition("+")
    wanted = ASYNC_DRIVERS.get(backend)
    if wanted is None:
        raise ValueError(f"unsupported database {backend!r} in {parsed!r}: use sqlite or postgresql")
    if driver and parsed.drivername != wanted:
        raise ValueError(f"{parsed.drivername!r} is not supported: use {wanted!r} (or plain {backend!r})")
    parsed = parsed.set(drivername=wanted)
    path = sqlite_file(parsed)
    return parsed.set(database=str(path)) if path else parsed


def sqlite_file(url: URL) -> Path | None:
    """The file of an SQLite URL (~ expanded); None for other databases and in-memory ones."""
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    if url.database.startswith("file:"):  # an SQLite URI filename: left as given
        return None
    return Path(url.database).expanduser()


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")  # readers never wait on the writer (a no-op for :memory:)
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


class Database:
    """An async engine plus its session factory. Close it (or use `async with`) to release connections."""

    def __init__(self, url: str, echo: bool = False) -> None:
        self.url = async_url(url)
        self.is_sqlite = self.url.get_backend_name() == "sqlite"
        path = sqlite_file(self.url)
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.engine: AsyncEngine = create_async_engine(self.url, echo=echo)
        if self.is_sqlite:
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)

    def session(self) -> AsyncSession:
        return self.sessions()

    async def migrate(self) -> None:
        """Upgrades the schema to the newest migration (a no-op when it is current)."""
        from tokenfleet.store.migrate import upgrade

        await upgrade(self.engine)

    async def close(self) -> None:
        await self.engine.dispose()

    async def __aenter__(self) -> Database:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"Database({self.url!r})"  # URL's repr hides the password


async def migrate(url: str) -> None:
    """Upgrades the database at `url` to the newest schema."""
    async with Database(url) as db:
        await db.migrate()
