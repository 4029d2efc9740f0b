"""Hot tenants split into slices: the share arithmetic, rebalancing toward demand, and under load the total admitted
over a window never exceeds what one unsplit bucket allows (capacity + rate * window)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.quota.helpers import org, run, user
from tokenfleet.quota.limits import Limits
from tokenfleet.quota.slices import SlicePlan, apply_order, even_part, target_shares

N = 3


def test_target_shares_follow_demand_and_sum_to_one():
    floor = 0.25 / 4
    shares = target_shares([900, 100, 0, 0], [0.25] * 4, floor)
    assert abs(sum(shares) - 1) < 1e-12 and min(shares) == floor
    assert shares[0] == pytest.approx(floor + 0.75 * 0.9) and shares[1] == pytest.approx(floor + 0.75 * 0.1)
    assert target_shares([0, 0], [0.7, 0.3], 0.1) == [0.7, 0.3]  # no demand: unchanged
    assert sum(target_shares([0, 0], [0.5, 0.3], 0.1)) == pytest.approx(1)  # a half-done round is topped up


def test_shrinking_shares_are_written_first():
    assert apply_order([0.5, 0.3, 0.2], [0.2, 0.3, 0.5]) == [0, 2]
    assert apply_order([0.2, 0.5, 0.3], [0.6, 0.2, 0.2]) == [1, 2, 0]


def test_concurrency_and_daily_budget_are_split_evenly():
    assert [even_part(10, 3, k) for k in range(3)] == [4, 3, 3]
    assert even_part(None, 3, 0) is None
    plan = SlicePlan("acme", 2, 3)
    assert plan.tag == "acme#2" and plan.limits(Limits(60, 600, 10, 1000)) == Limits(60, 600, 3, 333)
    assert SlicePlan("acme").limits(Limits(1, 2, 3, 4)) == Limits(1, 2, 3, 4) and SlicePlan("acme").tag == "acme"


def _gateways(make_redis, **options):
    return [make_redis(hot_tenants={"acme": N}, slice_index=k, **options) for k in range(N)]


async def _close(quotas):
    await asyncio.gather(*(q.close() for q in quotas))


def test_rebalance_moves_share_toward_demand(make_redis):
    async def main():
        quotas = _gateways(make_redis, auto_rebalance=False, rebalance_interval_s=0.1)
        try:
            scope = org(tokens_per_minute=60_000)
            for i in range(20):
                await quotas[0].reserve(f"a{i}", [scope], 100)
            await quotas[1].reserve("b", [scope], 100)
            assert [await quotas[0].share("acme", k) for k in range(N)] == [1 / N] * N
            shares = await quotas[0].rebalancer("acme").rebalance_once()
            assert await quotas[1].rebalancer("acme").rebalance_once() is None  # the other gateway's lock
            stored = [await quotas[2].share("acme", k) for k in range(N)]
            assert stored == pytest.approx(shares) and sum(stored) == pytest.approx(1)
            floor = 0.25 / N
            assert stored[0] == pytest.approx(floor + (1 - N * floor) * 2000 / 2100) and stored[2] == floor
            await asyncio.sleep(0.12)  # lock lapsed; no demand since: nothing moves
            assert await quotas[2].rebalancer("acme").rebalance_once() == pytest.approx(stored)
        finally:
            await _close(quotas)

    run(main())


def test_sliced_request_sizes_and_split_limits(make_redis):
    async def main():
        quotas = _gateways(make_redis, auto_rebalance=False)
        try:
            scope = org(tokens_per_minute=60_000, concurrent_requests=4)
            # one slice holds 20,000 now and at most 60,000 * (1 - 2 * 0.25/3) = 50,000 ever
            assert (await quotas[0].reserve("big", [scope], 50_001)).reason == "request_too_large"
            wait = await quotas[0].reserve("later", [scope], 30_000)
            assert wait.reason == "tokens_per_minute" and wait.retry_after_s > 0
            first = await quotas[0].reserve("r0", [scope], 100)
            assert first.allowed and first.reservation.slice == 0
            assert (await quotas[0].reserve("r1", [scope], 100)).allowed  # concurrency 4 -> slices hold 2, 1, 1
            assert (await quotas[0].reserve("r2", [scope], 100)).reason == "concurrent_requests"
            assert (await quotas[1].reserve("r3", [scope], 100)).allowed
            assert (await quotas[1].reserve("r4", [scope], 100)).reason == "concurrent_requests"
            await quotas[0].reconcile(first.reservation, 0)  # back into slice 0
            assert (await quotas[0].remaining(scope)).concurrent == 1
            assert (await quotas[0].remaining(scope)).tokens >= 20_000 - 100
            assert (await quotas[1].remaining(user(tokens_per_minute=60))).tokens == 20  # users split the same way
        finally:
            await _close(quotas)

    run(main())


def test_total_admitted_never_exceeds_the_tenant_limit(make_redis):
    """Slice 0 hammered, slice 1 light, slice 2 idle, rebalancing every 0.2 s: over the window the three slices
    together admit at most capacity + rate * window, and slice 0 gets well above its even third."""
    limit, rate, size = 60_000, 1000.0, 10

    async def hammer(quota, scope, until, pause, name):
        admitted = 0
        while time.time() < until:
            if (await quota.reserve(f"{name}{admitted}-{time.time()}", [scope], size)).allowed:
                admitted += size
            await asyncio.sleep(pause)
        return admitted

    async def main():
        quotas = _gateways(make_redis, rebalance_interval_s=0.2)
        scope = org(tokens_per_minute=limit)
        try:
            for k, quota in enumerate(quotas):  # drain each slice's initial third
                level = (await quota.remaining(scope)).tokens
                assert (await quota.reserve(f"drain{k}", [scope], int(level))).allowed
            start = time.time()
            left = sum([(await q.remaining(scope)).tokens for q in quotas])
            until = start + 2.0
            heavy, light = await asyncio.gather(
                hammer(quotas[0], scope, until, 0, "h"), hammer(quotas[1], scope, until, 0.05, "l")
            )
            window = time.time() - start
            assert heavy + light <= left + rate * window
            assert heavy > 1.5 * rate * window / N  # rebalanced: far above its even share
            shares = [await quotas[0].share("acme", k) for k in range(N)]
            assert sum(shares) == pytest.approx(1) and shares[0] > 0.6
        finally:
            await _close(quotas)

    run(main())
