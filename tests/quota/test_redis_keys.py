"""Redis specifics: every key of a request under one hash tag, every key expiring, NOSCRIPT handled."""

from __future__ import annotations

import asyncio
import uuid

import redis

from tests.quota.helpers import REDIS_URL, opened, org, run, user
from tokenfleet.quota.redis_client import CallTemplate, Script, ScriptCall


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


def _hash_key(prefix: str, scope: str = "org:acme") -> str:
    return f"{prefix}{{acme}}:{scope}:q"


def test_a_hash_gets_a_new_expiry_only_when_it_needs_a_later_one(make_redis, prefix):
    """Most writes cost no PEXPIRE: the hash keeps the expiry it was given, with slack, while that is late enough."""
    client = redis.Redis.from_url(REDIS_URL)

    async def main():
        async with opened(make_redis) as quota:
            scope = org(tokens_per_minute=60_000)  # 1,000 tokens/s refill
            await quota.reserve("r0", [scope], 10)  # idle 0.01 s: needs to live 60 s more
            first = client.pexpiretime(_hash_key(prefix))
            await quota.reserve("r1", [scope], 10)
            assert client.pexpiretime(_hash_key(prefix)) == first  # late enough still: left alone
            decision = await quota.reserve("r2", [scope], 10)
            await quota.reconcile(decision.reservation, 100_000)  # 40,000 in debt: 100 s to refill, lives 160 s
            assert client.pexpiretime(_hash_key(prefix)) - first >= 35_000
            assert client.pttl(_hash_key(prefix)) >= 160_000 - 2_000  # never short of what it needs

    run(main())
    client.close()


def test_a_hash_an_older_script_wrote_gets_its_expiry_again(make_redis, prefix):
    """A hash whose last write did not keep its expiry (a gateway of the previous version, during a rolling upgrade:
    it writes `a` and its own, shorter TTL) is given the expiry it needs on its next write."""
    client = redis.Redis.from_url(REDIS_URL)

    async def main():
        async with opened(make_redis) as quota:
            scope = org(tokens_per_minute=60_000)
            await quota.reserve("r0", [scope], 30_000)  # needs ~90 s
            key = _hash_key(prefix)
            level = float(client.hget(key, "t"))
            client.hset(key, mapping={"a": repr(float(client.hget(key, "a")) + 0.001), "t": repr(level)})
            client.pexpire(key, 5_000)  # what the older script set
            await quota.reserve("r1", [scope], 10)
            assert client.pttl(key) >= 89_000 - 2_000

    run(main())
    client.close()


def test_a_lease_set_never_holds_more_than_the_limit_and_expired_leases_are_pruned_at_it(make_redis, prefix):
    client = redis.Redis.from_url(REDIS_URL)

    async def main():
        async with opened(make_redis, lease_s=0.2) as quota:
            scope = org(concurrent_requests=3)
            for i in range(3):
                assert (await quota.reserve(f"crashed{i}", [scope], 1)).allowed  # never reconciled
            assert not (await quota.reserve("refused", [scope], 1)).allowed
            await asyncio.sleep(0.25)
            for i in range(3):  # the expired leases make room once the count reaches the limit
                assert (await quota.reserve(f"r{i}", [scope], 1)).allowed
            members = client.zrange(f"{prefix}{{acme}}:org:acme:leases", 0, -1)
            assert sorted(members) == [b"r0", b"r1", b"r2"]
            assert (await quota.remaining(scope)).concurrent == 0

    run(main())
    client.close()


def test_a_prepared_call_packs_what_a_plain_call_packs():
    script = Script("return 1")
    template = CallTemplate.of(script, ["k1", "k2é"], 1, 3, ["900.0", 2, "0", -1, 6000])
    call = template.call("marker", "rid-ü", -5, 20425)
    plain = ScriptCall(script, ["k1", "k2é", "marker"], ["rid-ü", -5, 20425, "900.0", 2, "0", -1, 6000])
    assert call.packed() == plain.packed() and call.packed(by_sha=False) == plain.packed(by_sha=False)
