"""Fixtures: a unique Redis key prefix per test (its keys deleted afterwards) and a backend factory parametrized
over memory and Redis."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis

from tests.quota.helpers import REDIS_URL
from tokenfleet.quota import MemoryQuota, RedisQuota
from tokenfleet.quota.leases import LeasedQuota


@pytest.fixture
def prefix() -> Any:
    value = f"tftest:quota:{uuid.uuid4().hex}:"
    yield value
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=value + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def make_redis(prefix: str) -> Callable[..., RedisQuota]:
    def make(**options: Any) -> RedisQuota:
        return RedisQuota.from_url(REDIS_URL, prefix, **options)

    return make


@pytest.fixture
def make_leased(make_redis: Callable[..., RedisQuota]) -> Callable[..., LeasedQuota]:
    def make(**options: Any) -> LeasedQuota:
        return LeasedQuota(make_redis(**options))

    return make


@pytest.fixture(params=["memory", "redis", "leased"])
def backend(
    request: pytest.FixtureRequest, make_redis: Callable[..., RedisQuota], make_leased: Callable[..., LeasedQuota]
) -> Callable[..., Any]:
    """make(**options) -> a fresh quota service of the parametrized backend (call it inside the event loop);
    "leased": Redis with local leases (leases.py), which must decide as Redis does."""
    if request.param == "memory":
        return lambda **options: MemoryQuota(**options)
    return make_redis if request.param == "redis" else make_leased
