"""Reconcile: exact refunds, charged shortfalls (debt), idempotence, released concurrency, lease expiry. Runs on
both backends."""

from __future__ import annotations

import asyncio
import datetime

from tests.quota.helpers import opened, org, run, user

RATE = 10.0  # tokens per second of tokens_per_minute=600


def test_refund_is_exact(backend):
    async def main():
        async with opened(backend) as quota:
            scope = org(tokens_per_minute=600, tokens_per_day=10_000)
            decision = await quota.reserve("r0", [scope], 300)
            await quota.reconcile(decision.reservation, 100)
            left = await quota.remaining(scope)
            assert 500 <= left.tokens < 500 + RATE * 0.5  # 600 - 100 used, plus what refilled meanwhile
            assert left.tokens_today == 9_900

    run(main())


def test_refund_is_capped_at_capacity(backend):
    async def main():
        async with opened(backend) as quota:
            scope = org(tokens_per_minute=600)
            decision = await quota.reserve("r0", [scope], 100)
            await asyncio.sleep(0.2)  # refills 2 of the 100
            await quota.reconcile(decision.reservation, 0)
            assert (await quota.remaining(scope)).tokens == 600

    run(main())


def test_shortfall_is_charged_as_debt(backend):
    async def main():
        async with opened(backend) as quota:
            scope = org(tokens_per_minute=600, tokens_per_day=10_000)
            decision = await quota.reserve("r0", [scope], 100)
            await quota.reconcile(decision.reservation, 700)
            left = await quota.remaining(scope)
            assert -100 <= left.tokens < -100 + RATE * 0.5 and left.tokens_today == 9_300
            refused = await quota.reserve("r1", [scope], 10)
            assert refused.reason == "tokens_per_minute" and 10.5 < refused.retry_after_s <= 11.0
            assert refused.headers["x-ratelimit-remaining-tokens"] == "0"

    run(main())


def test_reconcile_is_idempotent(backend):
    async def main():
        async with opened(backend) as quota:
            scope = org(tokens_per_minute=600, concurrent_requests=1, tokens_per_day=10_000)
            decision = await quota.reserve("r0", [scope], 300)
            await quota.reconcile(decision.reservation, 100)
            once = await quota.remaining(scope)
            other = await quota.reserve("r1", [scope], 50)  # holds the only slot again
            await quota.reconcile(decision.reservation, 100)
            await quota.reconcile(decision.reservation, 0)
            twice = await quota.remaining(scope)
            assert twice.tokens_today == once.tokens_today - 50 and twice.concurrent == 0
            assert 0 <= twice.tokens - (once.tokens - 50) < RATE * 0.5
            assert (await quota.reserve("r2", [scope], 10)).reason == "concurrent_requests"
            await quota.reconcile(other.reservation, 50)
            assert (await quota.reserve("r3", [scope], 10)).allowed

    run(main())


def test_reconcile_releases_concurrency_whatever_the_outcome(backend):
    async def main():
        async with opened(backend) as quota:
            scope = org(concurrent_requests=1, tokens_per_minute=600)
            for outcome, used in (("finished", 80), ("cancelled", 3), ("failed", 0)):
                decision = await quota.reserve(outcome, [scope], 100)
                assert decision.allowed
                assert (await quota.reserve(outcome + "-2", [scope], 100)).reason == "concurrent_requests"
                await quota.reconcile(decision.reservation, used)
                assert (await quota.remaining(scope)).concurrent == 1

    run(main())


def test_lease_expiry_frees_a_slot_a_crashed_gateway_held(backend):
    async def main():
        async with opened(backend, lease_s=0.3) as quota:
            scope = org(concurrent_requests=1)
            assert (await quota.reserve("never-reconciled", [scope], 1)).allowed
            assert not (await quota.reserve("r1", [scope], 1)).allowed
            await asyncio.sleep(0.35)
            assert (await quota.reserve("r2", [scope], 1)).allowed

    run(main())


def test_reservation_records_what_was_charged(backend):
    async def main():
        async with opened(backend) as quota:
            scopes = [org(tokens_per_day=1000), user(requests_per_minute=5)]
            reservation = (await quota.reserve("r0", scopes, 42)).reservation
            assert reservation.request_id == "r0" and reservation.tokens == 42
            assert reservation.scopes == tuple(scopes) and reservation.backend == quota.name
            assert reservation.day == datetime.datetime.now(datetime.UTC).date().isoformat()

    run(main())
