"""Redis specifics: every key of a request under one hash tag, every key expiring, NOSCRIPT handled."""

from __future__ import annotations

import uuid

import redis

from tests.quota.helpers import REDIS_URL, opened, org, run, user
from tokenfleet.quota.redis_client import Script


def test_keys_share_the_tenant_hash_tag_and_all_expire(make_redis, prefix):
    async def main():
        async with opened(make_redis) as quota:
            limits = {
                "requests_per_minute": 60,
                "tokens_per_minute": 600,
                "concurrent_requests": 2,
                "tokens_per_day": 1000,
            }
            decision = await quota.reserve("r0", [org(**limits), user(**limits)], 100)
            await quota.reconcile(decision.reservation, 50)
            await quota.reserve("r1", [org(**limits), user(**limits)], 100)

    run(main())
    client = redis.Redis.from_url(REDIS_URL)
    keys = [k.decode() for k in client.scan_iter(match=prefix + "*")]
    assert keys and all(k.startswith(prefix + "{acme}:") for k in keys)
    assert all(client.pttl(k) > 0 for k in keys)  # nothing lives forever: idle tenants cost nothing
    assert {k.rsplit(":", 1)[1] for k in keys} == {"q", "leases", "r0"}  # r0: the short-lived reconcile marker
    client.close()


def test_a_script_the_server_does_not_know_is_loaded(make_redis):
    async def main():
        async with opened(make_redis) as quota:
            script = Script(f"return 'fresh' -- {uuid.uuid4().hex}")  # never loaded: EVALSHA answers NOSCRIPT
            assert await quota.store.run(script, [], []) == b"fresh"
            assert await quota.store.client.script_exists(script.sha) == [True]
            assert await quota.store.run(script, [], []) == b"fresh"

    run(main())
