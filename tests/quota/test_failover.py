"""Outages: a Redis nobody listens on, one that never answers, and a proxy the test cuts mid-run and restores.
Closed tiers get QuotaUnavailable fast, open tiers are decided locally, reconciles made during the outage arrive
once Redis is back."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest

from tests.quota.helpers import Proxy, opened, org, run, silent_server
from tokenfleet.quota import FailoverQuota, MemoryQuota, QuotaStoreError, QuotaUnavailable, RedisQuota

POLICY = {"paid": "open", "free": "closed"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def failover(url: str, prefix: str, breaker_s: float = 1.0) -> FailoverQuota:
    return FailoverQuota(RedisQuota.from_url(url, prefix), MemoryQuota(), POLICY, breaker_s=breaker_s)


def test_nothing_listening(prefix):
    async def main():
        url = f"redis://127.0.0.1:{free_port()}"
        async with opened(RedisQuota.from_url, url=url, prefix=prefix) as bare:
            with pytest.raises(QuotaStoreError):
                await bare.reserve("r0", [org(tokens_per_minute=100)], 1)
        async with opened(failover, url=url, prefix=prefix) as quota:
            started = time.monotonic()
            with pytest.raises(QuotaUnavailable):
                await quota.reserve("r1", [org(tokens_per_minute=100)], 1, tier="free")
            assert time.monotonic() - started < 1.0
            decision = await quota.reserve("r2", [org(tokens_per_minute=100)], 60, tier="paid")
            assert decision.allowed and decision.reservation.backend == "memory"
            refused = await quota.reserve("r3", [org(tokens_per_minute=100)], 60, tier="paid")
            assert refused.reason == "tokens_per_minute"  # the local limiter enforces the same limits
            await quota.reconcile(decision.reservation, 10)  # held locally: reconciled locally, nothing pending
            assert (quota.outages, quota.fallback_decisions, quota.unavailable) == (1, 2, 1)
            assert quota.pending_reconciles == 0 and quota.in_outage

    run(main())


def test_hung_redis_fails_within_the_timeout(prefix, caplog):
    caplog.set_level(logging.WARNING, logger="tokenfleet.quota")

    async def main():
        server = await silent_server()
        url = f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            async with opened(failover, url=url, prefix=prefix) as quota:
                started = time.monotonic()
                with pytest.raises(QuotaUnavailable):
                    await quota.reserve("r0", [org(tokens_per_minute=100)], 1, tier="free")
                assert time.monotonic() - started < 1.0
                # the breaker is open: the next requests do not wait for Redis at all
                started = time.monotonic()
                for i in range(20):
                    with pytest.raises(QuotaUnavailable):
                        await quota.reserve(f"f{i}", [org(tokens_per_minute=100)], 1, tier="free")
                    assert (await quota.reserve(f"p{i}", [org(tokens_per_minute=10_000)], 1, tier="paid")).allowed
                assert time.monotonic() - started < 0.2 and quota.outages == 1
        finally:
            server.close()

    run(main())
    assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 1  # one warning per outage


def test_unknown_tier_uses_the_default_policy(prefix):
    async def main():
        url = f"redis://127.0.0.1:{free_port()}"
        quota = FailoverQuota(RedisQuota.from_url(url, prefix), MemoryQuota(), POLICY, default_policy="closed")
        async with opened(lambda: quota):
            with pytest.raises(QuotaUnavailable):
                await quota.reserve("r0", [org()], 1, tier="mystery")

    run(main())


def test_outage_and_recovery_through_a_proxy(prefix):
    async def main():
        proxy = Proxy()
        await proxy.start()
        scope = org(tokens_per_minute=600, concurrent_requests=2, tokens_per_day=10_000)
        async with opened(failover, url=f"redis://127.0.0.1:{proxy.port}", prefix=prefix, breaker_s=0.2) as quota:
            held = await quota.reserve("before", [scope], 300, tier="paid")
            assert held.allowed and held.reservation.backend == "redis"

            await proxy.stop()
            started = time.monotonic()
            with pytest.raises(QuotaUnavailable):
                await quota.reserve("free-1", [scope], 10, tier="free")
            assert time.monotonic() - started < 1.0
            local = await quota.reserve("paid-1", [scope], 10, tier="paid")
            assert local.allowed and local.reservation.backend == "memory"
            await quota.reconcile(held.reservation, 100)  # Redis is down: kept, not lost
            assert quota.pending_reconciles == 1 and quota.outages == 1

            await proxy.start()
            for _ in range(100):  # the pending reconcile is retried in the background
                if quota.pending_reconciles == 0:
                    break
                await asyncio.sleep(0.05)
            assert quota.pending_reconciles == 0 and quota.reconciles_replayed == 1
            left = await quota.primary.remaining(scope)
            assert 500 <= left.tokens < 520 and left.concurrent == 2 and left.tokens_today == 9_900
            after = await quota.reserve("after", [scope], 10, tier="paid")
            assert after.allowed and after.reservation.backend == "redis" and not quota.in_outage
            await quota.reconcile(local.reservation, 10)  # the one decided locally is settled locally
        await proxy.stop()

    run(main())


def test_reconcile_is_kept_until_delivered_even_across_failed_retries(prefix):
    async def main():
        proxy = Proxy()
        await proxy.start()
        scope = org(tokens_per_minute=600)
        async with opened(failover, url=f"redis://127.0.0.1:{proxy.port}", prefix=prefix, breaker_s=0.1) as quota:
            held = [(await quota.reserve(f"r{i}", [scope], 100, tier="paid")).reservation for i in range(3)]
            await proxy.stop()
            for reservation in held:
                await quota.reconcile(reservation, 0)
            await asyncio.sleep(0.5)  # several retries fail meanwhile
            assert quota.pending_reconciles == 3
            await proxy.start()
            await quota.flush_pending()  # or the background retry gets there first
            assert quota.pending_reconciles == 0
            assert (await quota.primary.remaining(scope)).tokens == 600
            await quota.flush_pending()  # nothing left, nothing twice
            assert quota.reconciles_replayed == 3
        await proxy.stop()

    run(main())


def test_policy_validation():
    with pytest.raises(ValueError):
        FailoverQuota(MemoryQuota(), MemoryQuota(), {"paid": "maybe"})
    with pytest.raises(ValueError):
        FailoverQuota(MemoryQuota(), MemoryQuota(), {}, breaker_s=-1)


def test_without_a_breaker_every_request_tries_redis_and_pending_retries_do_not_spin(prefix):
    async def main():
        proxy = Proxy()
        await proxy.start()
        scope = org(tokens_per_minute=600)
        async with opened(failover, url=f"redis://127.0.0.1:{proxy.port}", prefix=prefix, breaker_s=0) as quota:
            held = await quota.reserve("r0", [scope], 100, tier="paid")
            await proxy.stop()
            assert (await quota.reserve("r1", [scope], 100, tier="paid")).reservation.backend == "memory"
            await quota.reconcile(held.reservation, 0)
            await asyncio.sleep(0.35)  # retries pause between attempts instead of spinning
            assert quota.pending_reconciles == 1
            await proxy.start()
            assert (await quota.reserve("r2", [scope], 100, tier="paid")).reservation.backend == "redis"
            for _ in range(40):
                if quota.pending_reconciles == 0:
                    break
                await asyncio.sleep(0.05)
            assert quota.pending_reconciles == 0 and quota.outages == 1
        await proxy.stop()

    run(main())
