"""Fixtures: SQL tests run on an SQLite file and on a throwaway PostgreSQL database (as in tests/store), each
freshly migrated; Redis tests get a unique stream key, deleted afterwards."""
from __future__ import annotations

import uuid
from typing import Any, Callable

import pytest
import redis

from tests.metering.helpers import REDIS_URL
from tests.store.backends import (POSTGRES_ADMIN_URL, create_postgres_database, database_url,
                                  drop_postgres_database, reset_postgres_database)
from tokenfleet.metering import EventLog, MemoryLog, Outbox, RedisStreamLog
from tokenfleet.store.db import Database


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
        return f"sqlite:///{tmp_path / 'usage.db'}"
    url = request.getfixturevalue("postgres_url")
    reset_postgres_database(url)
    return url


@pytest.fixture
async def db(db_url: str):
    async with Database(db_url) as database:
        await database.migrate()
        yield database


@pytest.fixture
def outbox(db: Database) -> Outbox:
    return Outbox(db)


@pytest.fixture
def stream_key() -> Any:
    prefix = f"tftest:metering:{uuid.uuid4().hex}:"
    yield prefix + "usage"
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
async def make_redis_log(stream_key: str):
    """make(url=REDIS_URL, **options) -> a RedisStreamLog on this test's stream (closed after the test)."""
    made: list[RedisStreamLog] = []

    def make(url: str = REDIS_URL, **options: Any) -> RedisStreamLog:
        made.append(RedisStreamLog.from_url(url, stream_key, "warehouse", **options))
        return made[-1]
    yield make
    for stream_log in made:
        await stream_log.close()


@pytest.fixture(params=["memory", "redis"])
def make_log(request: pytest.FixtureRequest) -> Callable[..., EventLog]:
    """make(**options) -> a fresh log of the parametrized kind. Two Redis logs made in one test share the stream
    (like two processes); a second MemoryLog is a separate log."""
    if request.param == "memory":
        return lambda **options: MemoryLog(**options)
    return request.getfixturevalue("make_redis_log")
