"""Fixtures: SQL tests run on an SQLite file and on a throwaway PostgreSQL database (as in tests/store), each
freshly migrated; Redis tests get a unique stream key, deleted afterwards."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tests.metering.helpers import REDIS_URL
from tests.servers import delete_redis_keys
from tokenfleet.metering import EventLog, MemoryLog, Outbox, RedisStreamLog
from tokenfleet.store.db import Database


@pytest.fixture
async def outbox(db: Database) -> Any:
    outbox = Outbox(db)
    yield outbox
    await outbox.aclose()


@pytest.fixture
def stream_key() -> Any:
    prefix = f"tftest:metering:{uuid.uuid4().hex}:"
    yield prefix + "usage"
    delete_redis_keys(prefix)


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
