"""Extending a running request's reservation: granted up to what every scope's daily budget and tokens-per-minute
bucket hold, nothing under the least it needs, never after its reconcile. Runs on both backends."""

from __future__ import annotations

import asyncio

import pytest

from tests.quota.helpers import Proxy, opened, org, run, user
from tokenfleet.quota import FailoverQuota, MemoryQuota, QuotaUnavailable, RedisQuota


def test_extension_is_granted_up_to_the_daily_budget_then_refused(backend):
    async def main():
        async with opened(backend) as quota:
            scopes = [org(tokens_per_day=1000), user(tokens_per_day=10_000)]
            reservation = (await quota.reserve("r0", scopes, 900)).reservation
            extended = await quota.extend(reservation, 10, 64)
            assert extended.tokens == 964 and (await quota.remaining(scopes[0])).tokens_today == 36
            partial = await quota.extend(extended, 1, 64)
            assert partial.tokens == 1000 and (await quota.remaining(scopes[0])).tokens_today == 0
            assert await quota.extend(partial, 1, 64) is None
            assert (await quota.remaining(scopes[1])).tokens_today == 9000  # both scopes charged alike

    run(main())


def test_nothing_is_charged_when_less_than_needed_is_left(backend):
    async def main():
        async with opened(backend) as quota:
            scope = org(tokens_per_day=1000)
            reservation = (await quota.reserve("r0", [scope], 980)).reservation
            assert await quota.extend(reservation, 30, 64) is None
            assert (await quota.remaining(scope)).tokens_today == 20

    run(main())


def test_extension_takes_from_the_tokens_per_minute_bucket(backend):
    async def main():
        async with opened(backend) as quota:
            scope = org(tokens_per_minute=600)
            reservation = (await quota.reserve("r0", [scope], 500)).reservation
            extended = await quota.extend(reservation, 1, 64)
            assert extended.tokens == 564 and (await quota.remaining(scope)).tokens < 37
            rest = await quota.extend(extended, 1, 1000)
            assert 564 + 36 <= rest.tokens < 564 + 40  # the bucket's level, refilled a little meanwhile
            await quota.reconcile(rest, 200)  # what it did not use comes back
            assert (await quota.remaining(scope)).tokens >= 400

    run(main())


def test_the_reconcile_settles_the_extended_reservation(backend):
    async def main():
        async with opened(backend) as quota:
            scope = org(tokens_per_day=1000, concurrent_requests=1)
            reservation = (await quota.reserve("r0", [scope], 300)).reservation
            extended = await quota.extend(reservation, 64, 64)
            await quota.reconcile(extended, 340)
            left = await quota.remaining(scope)
            assert left.tokens_today == 660 and left.concurrent == 1
            assert await quota.extend(extended, 1, 64) is None  # a finished request gets no more
            assert (await quota.remaining(scope)).tokens_today == 660

    run(main())


def test_concurrent_extensions_never_grant_more_than_the_budget(backend):
    async def main():
        async with opened(backend) as quota:
            scope = org(tokens_per_day=2700)
            reservations = [(await quota.reserve(f"r{i}", [scope], 270)).reservation for i in range(10)]
            assert (await quota.reserve("r10", [scope], 270)).allowed is False
            for _ in range(3):
                grown = await asyncio.gather(*(quota.extend(r, 1, 64) for r in reservations))
                assert all(g is None for g in grown)
            await quota.reconcile(reservations[0], 100)  # 170 comes back, and is shared out again
            grown = await asyncio.gather(*(quota.extend(r, 1, 64) for r in reservations[1:]))
            assert sum(g.tokens - r.tokens for g, r in zip(grown, reservations[1:]) if g) == 170
            assert (await quota.remaining(scope)).tokens_today == 0

    run(main())


def test_bad_extensions_are_refused(backend):
    async def main():
        async with opened(backend) as quota:
            reservation = (await quota.reserve("r0", [org(tokens_per_day=1000)], 10)).reservation
            for least, most in ((0, 10), (20, 10), (-1, 5), (1, True)):
                with pytest.raises(ValueError):
                    await quota.extend(reservation, least, most)

    run(main())


def test_failover_extends_where_the_reservation_is_held_and_says_when_it_cannot(prefix):
    async def main():
        proxy = Proxy()
        await proxy.start()
        quota = FailoverQuota(
            RedisQuota.from_url(f"redis://127.0.0.1:{proxy.port}", prefix),
            MemoryQuota(),
            {"paid": "open"},
            breaker_s=5.0,
        )
        async with opened(lambda: quota):
            scope = org(tokens_per_day=1000)
            in_redis = (await quota.reserve("r0", [scope], 900, tier="paid")).reservation
            assert (await quota.extend(in_redis, 1, 64)).tokens == 964
            await proxy.stop()
            with pytest.raises(QuotaUnavailable):
                await quota.extend(in_redis, 1, 64)
            local = (await quota.reserve("r1", [scope], 990, tier="paid")).reservation
            assert local.backend == "memory" and (await quota.extend(local, 1, 64)).tokens == 1000

    run(main())
