"""Every store test runs twice: on an SQLite file and on PostgreSQL, each freshly migrated."""
from __future__ import annotations

import pytest

from tests.store.backends import (POSTGRES_ADMIN_URL, create_postgres_database, database_url,
                                  drop_postgres_database, reset_postgres_database)
from tokenfleet.store.db import Database
from tokenfleet.store.tenants import TenantStore

TIERS = ("free", "paid", "enterprise", "batch")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def postgres_url():
    try:
        name = create_postgres_database()
    except OSError as e:
        pytest.fail(f"no PostgreSQL at {POSTGRES_ADMIN_URL} ({e}); .ci/run starts it, or set "
                    "TOKENFLEET_TEST_POSTGRES")
    yield database_url(name)
    drop_postgres_database(name)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'tenants.db'}"
    url = request.getfixturevalue("postgres_url")
    reset_postgres_database(url)
    return url


@pytest.fixture
async def db(db_url: str):
    async with Database(db_url) as database:
        await database.migrate()
        yield database


@pytest.fixture
async def store(db: Database) -> TenantStore:
    return TenantStore(db, tiers=TIERS)
