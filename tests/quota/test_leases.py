"""Local leases (quota/leases.py): far from its limits a scope's requests are decided in the gateway process, from
budget it took from Redis ahead; limits still hold across gateways, to the request, because a lease is a real charge
and near a limit every request is decided in Redis after the process gave back what it held. The shared semantics
suite runs on this backend too (conftest's "leased")."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.quota.helpers import Proxy, org, run, user
from tokenfleet.quota import Decision, QuotaStoreError, RedisQuota
from tokenfleet.quota.leases import LeasedQuota

PAID_ORG = dict(requests_per_minute=6000, tokens_per_minute=2_000_000, concurrent_requests=256)
PAID_USER = dict(requests_per_minute=600, tokens_per_minute=200_000, concurrent_requests=32, tokens_per_day=10**7)


class Counted(RedisQuota):
    """Counts the script calls that reach Redis."""

    calls = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        run_call, run_script = self.store.run_call, self.store.run

        async def counted_call(call: Any) -> Any:
            self.calls += 1
            return await run_call(call)

        async def counted_run(script: Any, keys: Any, args: Any) -> Any:
            self.calls += 1
            return await run_script(script, keys, args)

        self.store.run_call = counted_call  # type: ignore[method-assign]
        self.store.run = counted_run  # type: ignore[method-assign]


@contextlib.asynccontextmanager
async def gateways(prefix: str, count: int = 1, **options: Any) -> AsyncIterator[list[LeasedQuota]]:
    quotas = [LeasedQuota(Counted.from_url("redis://127.0.0.1:6379", prefix), **options) for _ in range(count)]
    try:
        yield quotas
    finally:
        for quota in quotas:
            await quota.close()


def test_far_from_its_limits_a_scope_is_decided_here_with_a_redis_call_per_lease_not_per_request(prefix):
    async def main() -> None:
        async with gateways(prefix) as [quota]:
            scopes = [org(**PAID_ORG), user(**PAID_USER)]
            for i in range(200):
                decision = await quota.reserve(f"r{i}", scopes, 500)
                assert decision.allowed, decision
                assert decision.headers["x-ratelimit-limit-requests"] == "600"
                await quota.reconcile(decision.reservation, 100)
            assert quota.local_decisions >= 180, quota.local_decisions
            assert isinstance(quota.inner, Counted) and quota.inner.calls <= 80, quota.inner.calls  # strict: 400
            await quota.give_back()
            left = await quota.inner.remaining(scopes[1])  # Redis's own view, once everything came back
            assert left.tokens_today == 10**7 - 200 * 100 and left.concurrent == 32
            assert 600 - 200 <= left.requests <= 600 - 200 + 5, left  # + what refilled meanwhile

    run(main())


def test_two_gateways_admit_exactly_a_limit_of_requests_between_them(prefix):
    async def main() -> None:
        async with gateways(prefix, 2) as quotas:
            scopes = [org("t", requests_per_minute=320)]
            admitted, refused_in_a_row, started = 0, 0, time.monotonic()
            i = 0
            while refused_in_a_row < 10:
                decision = await quotas[i % 2].reserve(f"r{i}", scopes, 1)
                i += 1
                admitted, refused_in_a_row = (admitted + 1, 0) if decision.allowed else (admitted, refused_in_a_row + 1)
                if not decision.allowed:
                    assert decision.reason == "requests_per_minute" and decision.retry_after_s is not None
            refilled = (time.monotonic() - started) * 320 / 60
            assert 320 <= admitted <= 320 + refilled + 1, (admitted, refilled)
            assert sum(q.local_decisions for q in quotas) > 100, "no request was decided from a lease"

    run(main())


def test_two_gateways_hold_exactly_a_concurrency_limit_and_free_every_slot(prefix):
    async def main() -> None:
        async with gateways(prefix, 2) as quotas:
            scopes = [org("t", concurrent_requests=64), user("t", 1, requests_per_minute=10**6)]
            held: list[tuple[LeasedQuota, Decision]] = []
            refused = 0
            for i in range(200):
                quota = quotas[i % 2]
                decision = await quota.reserve(f"r{i}", scopes, 1)
                if decision.allowed:
                    held.append((quota, decision))
                else:
                    refused += 1
                    assert decision.reason == "concurrent_requests"
            assert len(held) == 64, len(held)
            for quota, decision in held:
                await quota.reconcile(decision.reservation, 1)
            for quota in quotas:
                await quota.give_back()
            assert (await quotas[0].inner.remaining(scopes[0])).concurrent == 64

    run(main())


def test_what_requests_used_is_charged_exactly_and_the_rest_comes_back(prefix):
    async def main() -> None:
        rng = random.Random(7)
        async with gateways(prefix, 2) as quotas:
            scopes = [org("t", tokens_per_minute=1_600_000, tokens_per_day=10**7)]
            used = 0
            for i in range(300):
                quota = quotas[rng.randrange(2)]
                decision = await quota.reserve(f"r{i}", scopes, 1000)
                assert decision.allowed, decision
                spent = rng.choice([0, 10, 999, 1000, 1700])  # beyond the reservation too (debt)
                used += spent
                await quota.reconcile(decision.reservation, spent)
                await quota.reconcile(decision.reservation, spent)  # a repeat changes nothing
            for quota in quotas:
                await quota.give_back()
            left = await quotas[0].inner.remaining(scopes[0])
            assert left.tokens_today == 10**7 - used, (left, used)
            assert 1_600_000 - used <= left.tokens <= 1_600_000, (left, used)

    run(main())


def test_near_a_limit_requests_are_decided_in_redis_after_the_lease_is_given_back(prefix):
    async def main() -> None:
        async with gateways(prefix, 2) as [a, b]:
            scopes = [org("t", requests_per_minute=6000)]
            for i in range(100):  # a takes leases and holds some requests it has not granted
                assert (await a.reserve(f"a{i}", scopes, 1)).allowed
            local_before = a.local_decisions
            # b uses the scope up to its last quarter: from there every lease is refused
            i = 0
            while (await b.inner.remaining(scopes[0])).requests >= 6000 * 0.25 + 50:
                assert (await b.reserve(f"b{i}", scopes, 1)).allowed
                i += 1
            # a goes on from the lease it holds (a real charge, taken far from the limit), then goes to Redis
            for j in range(1000):
                local = a.local_decisions
                assert (await a.reserve(f"a-late{j}", scopes, 1)).allowed
                if a.local_decisions == local:
                    break
            assert a.local_decisions - local_before < 1000, "every late request was still decided from a lease"
            assert not a._leases, "a still holds a lease of a scope near its limit"
            held, in_redis = await a.remaining(scopes[0]), await a.inner.remaining(scopes[0])
            assert abs(held.requests - in_redis.requests) < 1, "a holds requests it gave no one"

    run(main())


def test_extend_goes_to_redis_and_is_refused_once_reconciled(prefix):
    async def main() -> None:
        async with gateways(prefix) as [quota]:
            scopes = [org("t", tokens_per_minute=1_600_000, tokens_per_day=10**7)]
            decisions = [await quota.reserve(f"w{i}", scopes, 100) for i in range(5)]
            assert quota.local_decisions >= 3
            last = decisions[-1].reservation
            assert last is not None
            grown = await quota.extend(last, 50, 50)
            assert grown is not None and grown.tokens == 150
            await quota.reconcile(grown, 120)
            assert await quota.extend(grown, 1, 10) is None
            for decision in decisions[:-1]:
                assert decision.reservation is not None
                await quota.reconcile(decision.reservation, 0)
            await quota.give_back()
            assert (await quota.inner.remaining(scopes[0])).tokens_today == 10**7 - 120


def test_concurrent_requests_share_one_lease_taking_and_a_burst_goes_on_in_redis(prefix):
    async def main() -> None:
        async with gateways(prefix) as [quota]:
            scopes = [org("t", **PAID_ORG)]
            decisions = await asyncio.gather(*(quota.reserve(f"r{i}", scopes, 10) for i in range(50)))
            assert all(d.allowed for d in decisions)
            assert isinstance(quota.inner, Counted) and quota.inner.calls < 50, quota.inner.calls
            assert len(quota._leases) == 1

    run(main())


def test_limits_too_small_to_share_out_never_get_a_lease(prefix):
    async def main() -> None:
        async with gateways(prefix) as [quota]:
            scopes = [org("t", requests_per_minute=20, concurrent_requests=8)]
            for i in range(10):
                decision = await quota.reserve(f"r{i}", scopes, 1)
                assert decision.allowed and decision.reservation is not None
                await quota.reconcile(decision.reservation, 1)
            assert quota.local_decisions == 0 and not quota._leases

    run(main())


def test_while_redis_is_down_leases_go_on_a_lease_not_taken_is_an_outage_and_what_is_due_goes_back_later(prefix):
    async def main() -> None:
        proxy = Proxy()
        await proxy.start()
        inner = RedisQuota.from_url(f"redis://127.0.0.1:{proxy.port}", prefix)
        quota = LeasedQuota(inner, idle_s=0.2)
        try:
            scopes = [org("t", tokens_per_minute=1_600_000, tokens_per_day=10**7)]
            held = [await quota.reserve(f"r{i}", scopes, 100) for i in range(3)]
            assert all(d.allowed for d in held) and quota.local_decisions >= 1
            await proxy.stop()
            more = await quota.reserve("during", scopes, 100)  # from the lease it holds: no Redis needed
            assert more.allowed and more.reservation is not None and more.reservation.leased
            with pytest.raises(QuotaStoreError):  # a scope with no lease: the failover's outage path
                await quota.reserve("other", [org("u", tokens_per_minute=1_600_000)], 100)
            for decision in [*held, more]:
                assert decision.reservation is not None
                await quota.reconcile(decision.reservation, 40)
            await asyncio.sleep(1.5)  # idle: stopped, its settlement fails and is kept
            assert quota.leases_held >= 1
            await proxy.start()
            for _ in range(100):
                if not quota.leases_held:
                    break
                await asyncio.sleep(0.05)
            assert not quota.leases_held, "what the lease held never went back"
            direct = RedisQuota.from_url("redis://127.0.0.1:6379", prefix)
            left = await direct.remaining(scopes[0])
            await direct.close()
            assert left.tokens_today == 10**7 - 4 * 40, left
        finally:
            await quota.close()
            await proxy.stop()

    run(main())


def test_a_living_gateways_lease_slots_are_renewed_and_a_killed_ones_expire_soon(prefix):
    async def main() -> None:
        inner = RedisQuota.from_url("redis://127.0.0.1:6379", prefix)
        quota = LeasedQuota(inner, slot_ttl_s=1.0)
        scope = org("t", concurrent_requests=64, requests_per_minute=10**6)
        zset = inner.scope_keys(inner.plan("t"), scope)[1]
        running = [await quota.reserve(f"r{i}", [scope], 1) for i in range(3)]  # never reconciled
        assert all(d.allowed and d.reservation is not None and d.reservation.leased for d in running)

        async def live() -> int:
            return int(await inner.store.command("ZCOUNT", zset, repr(time.time()), "+inf"))

        held = await live()
        assert held >= 3
        await asyncio.sleep(2.5)  # past the slots' first expiry: renewed meanwhile
        assert await live() == held, "a living gateway's slots expired"
        assert quota._settler is not None
        quota._settler.cancel()  # killed: nothing renews or gives back any more
        await asyncio.gather(quota._settler, return_exceptions=True)
        await asyncio.sleep(1.5)
        assert await live() == 0, "a dead gateway's lease slots still count"
        await inner.close()

    run(main())
