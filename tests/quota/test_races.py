"""1,000 concurrent reserves on a budget that fits exactly 10 admit exactly 10: through one client's connection
pool, and through several separate clients (against real Redis), and on the memory backend."""

from __future__ import annotations

import asyncio

from tests.quota.helpers import opened, org, run, user
from tokenfleet.quota import MemoryQuota

N = 1000
# these tests are about atomicity, not timeouts: 1,000 tasks started at once on a shared 2-core machine can stall
# the event loop past the 0.25 s defaults while the pools first connect
PATIENT = {"connect_timeout_s": 2.0, "socket_timeout_s": 2.0}


def _scopes():
    return [org(tokens_per_minute=1000), user(tokens_per_minute=1_000_000)]


def test_thousand_concurrent_reserves_one_client(make_redis):
    async def main():
        async with opened(make_redis, **PATIENT) as quota:
            decisions = await asyncio.gather(*(quota.reserve(f"r{i}", _scopes(), 100) for i in range(N)))
            assert sum(d.allowed for d in decisions) == 10
            assert {d.reason for d in decisions if not d.allowed} == {"tokens_per_minute"}
            left = await quota.remaining(_scopes()[0])
            assert 0 <= left.tokens < 100

    run(main())


def test_thousand_concurrent_reserves_many_clients(make_redis):
    async def main():
        quotas = [make_redis(**PATIENT) for _ in range(5)]
        try:
            decisions = await asyncio.gather(
                *(quotas[i % len(quotas)].reserve(f"r{i}", _scopes(), 100) for i in range(N))
            )
            assert sum(d.allowed for d in decisions) == 10
        finally:
            await asyncio.gather(*(q.close() for q in quotas))

    run(main())


def test_thousand_concurrent_reserves_memory():
    async def main():
        async with opened(MemoryQuota) as quota:
            decisions = await asyncio.gather(*(quota.reserve(f"r{i}", _scopes(), 100) for i in range(N)))
            assert sum(d.allowed for d in decisions) == 10

    run(main())


def test_concurrency_race_admits_exactly_the_limit(make_redis):
    async def main():
        async with opened(make_redis, **PATIENT) as quota:
            scope = [org(concurrent_requests=7)]
            decisions = await asyncio.gather(*(quota.reserve(f"r{i}", scope, 1) for i in range(300)))
            assert sum(d.allowed for d in decisions) == 7

    run(main())
