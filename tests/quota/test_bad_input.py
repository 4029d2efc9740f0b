"""Bad input is a ValueError, on every backend and through the failover wrapper (never a 503 or a refusal)."""

from __future__ import annotations

import pytest

from tests.quota.helpers import opened, org, run, user
from tokenfleet.quota import FailoverQuota, Limits, MemoryQuota, Reservation, Scope


@pytest.mark.parametrize("tokens", [-1, 1.5, True, "10", None])
def test_bad_tokens(backend, tokens):
    async def main():
        async with opened(backend) as quota:
            with pytest.raises(ValueError):
                await quota.reserve("r0", [org(tokens_per_minute=100)], tokens)

    run(main())


@pytest.mark.parametrize("scopes", [[], (), "org:acme", [org(), org()], [org("acme"), user("other")], [{"name": 1}]])
def test_bad_scopes(backend, scopes):
    async def main():
        async with opened(backend) as quota:
            with pytest.raises(ValueError):
                await quota.reserve("r0", scopes, 1)

    run(main())


def test_bad_request_id_and_used_tokens(backend):
    async def main():
        async with opened(backend) as quota:
            with pytest.raises(ValueError):
                await quota.reserve("", [org()], 1)
            reservation = (await quota.reserve("r0", [org(tokens_per_minute=100)], 10)).reservation
            with pytest.raises(ValueError):
                await quota.reconcile(reservation, -5)
            with pytest.raises(ValueError):
                await quota.reconcile("r0", 5)

    run(main())


def test_failover_raises_value_error_for_closed_tiers_too():
    async def main():
        quota = FailoverQuota(MemoryQuota(), MemoryQuota(), {"free": "closed"})
        with pytest.raises(ValueError):
            await quota.reserve("r0", [], 1, tier="free")
        with pytest.raises(ValueError):
            await quota.reserve("r0", [org()], -1, tier="free")
        with pytest.raises(ValueError):
            await quota.reconcile(Reservation("r0", (org(),), 1, "2024-01-01", "memory"), -1)

    run(main())


def test_bad_scope_records():
    for name, tenant in (("", "acme"), ("org:acme", ""), ("org:acme", "ac{me"), ("org:acme", "acme}")):
        with pytest.raises(ValueError):
            Scope(name, tenant, Limits())
    with pytest.raises(ValueError):
        Scope("org:acme", "acme", {"tokens_per_minute": 10})


def test_bad_options(make_redis):
    with pytest.raises(ValueError):
        MemoryQuota(lease_s=0)
    with pytest.raises(ValueError):
        make_redis(min_share=0)
    with pytest.raises(ValueError):
        make_redis(hot_tenants={"acme": 0})
    with pytest.raises(ValueError):
        from tokenfleet.quota import RedisQuota

        RedisQuota.from_url("redis://127.0.0.1:6379", "bad{prefix}:")
