"""The batch script (lua.BATCH) against the single scripts: a seeded random mix of reserves and reconciles on a few
shared scopes, run as one call of the batch script under one prefix and as the single scripts one at a time under
another, must give every call the same reply and leave the same keys, fields, members and expiries behind.

Time is the one difference: a batch runs at one instant, the single calls each at their own, a few milliseconds
apart. The limits are chosen so that this cannot change a decision (refill rates of a few units per second, levels
that start full and move by whole numbers), and levels, times and expiries are compared within what that refill and
that time allow; decisions, counts, daily usage, lease members and markers exactly."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from tests.quota.helpers import REDIS_URL, run
from tokenfleet.quota import Limits, RedisQuota, Scope
from tokenfleet.quota.redis import BATCH
from tokenfleet.quota.redis_client import BatchCall, BatchOp, OpTemplate, Script, ScriptCall, run_scripts

TENANTS = ("acme", "hot")  # "hot" is sliced: its calls carry the share hash
SLOW = 1.0  # the largest refill rate in these limits, per second (60 per minute)
SCOPES = {
    "org": Limits(requests_per_minute=60, tokens_per_minute=60, concurrent_requests=6, tokens_per_day=400),
    "user:1": Limits(requests_per_minute=8, tokens_per_minute=50, concurrent_requests=3),
    "user:2": Limits(tokens_per_minute=40, tokens_per_day=120),
    "user:3": Limits(concurrent_requests=2),
    "user:4": Limits(requests_per_minute=0),  # refuses everything
}


def scopes_of(rng: random.Random, tenant: str) -> tuple[Scope, ...]:
    users = rng.sample([name for name in SCOPES if name != "org"], rng.randint(0, 2))
    names = (["org"] if rng.random() < 0.8 or not users else []) + users
    return tuple(Scope(f"{name}:{tenant}", tenant, SCOPES[name]) for name in names)


def quota(client: aioredis.Redis, prefix: str, **options: Any) -> RedisQuota:
    return RedisQuota(client, prefix, hot_tenants={"hot": 2}, auto_rebalance=False, marker_ttl_s=600, **options)


class Plan:
    """The same calls for both prefixes: a few set-up calls made one at a time (some leases short enough to have
    expired when the batch runs), then the batch."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.setup: list[tuple[str, tuple[Scope, ...], int]] = [
            (f"old{i}", scopes_of(rng, rng.choice(TENANTS)), rng.randint(1, 30)) for i in range(rng.randint(0, 8))
        ]
        self.batch: list[tuple[Any, ...]] = []
        reserved: list[tuple[str, tuple[Scope, ...], int]] = []
        for i in range(rng.randint(2, 40)):
            if reserved and rng.random() < 0.35:
                rid, scopes, tokens = rng.choice(reserved)  # reconciled once, twice, or not at all
                self.batch.append(("c", rid, scopes, tokens, rng.randint(0, 60), rng.choice((0, 0, 0, -1))))
                continue
            rid = f"r{i}" if rng.random() < 0.9 else rng.choice(["r0", "old0", "dup"])  # some ids twice
            scopes = scopes_of(rng, rng.choice(TENANTS))
            tokens = rng.randint(1, 40)
            reserved.append((rid, scopes, tokens))
            self.batch.append(("r", rid, scopes, tokens))


async def apply(prefix: str, plan: Plan, batched: bool) -> list[Any]:
    client = aioredis.Redis.from_url(REDIS_URL)
    short, normal = quota(client, prefix, lease_s=0.05), quota(client, prefix, lease_s=30.0)
    try:
        for i, (rid, scopes, tokens) in enumerate(plan.setup):  # the first half: short leases, expired by the batch
            q = short if 2 * i < len(plan.setup) else normal
            await run_scripts(client, [q.prepared(scopes).reserve.call(rid, tokens)])
        await asyncio.sleep(0.1)
        today = int(time.time() // 86400)
        ops: list[BatchOp] = []
        for kind, rid, scopes, *rest in plan.batch:
            prepared = normal.prepared(scopes)
            if kind == "r":
                ops.append(prepared.reserve.call(rid, rest[0]))
            else:
                tokens, used, days_ago = rest
                ops.append(prepared.reconcile.call(prepared.marker_prefix + rid, rid, used - tokens, today - days_ago))
        if batched:
            [replies] = await run_scripts(client, [BatchCall(BATCH, ops)])
            return list(replies)
        return [(await run_scripts(client, [op]))[0] for op in ops]
    finally:
        await client.aclose()


def state(client: redis.Redis, prefix: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for raw in client.scan_iter(match=prefix + "*", count=1000):
        key = raw.decode()[len(prefix) :]
        kind = client.type(raw).decode()
        value: Any
        if kind == "hash":
            value = {k.decode(): v.decode() for k, v in client.hgetall(raw).items()}
        elif kind == "zset":
            value = {m.decode(): s for m, s in client.zrange(raw, 0, -1, withscores=True)}
        else:
            value = client.get(raw)
        found[key] = (kind, value, client.pttl(raw))
    return found


def close(a: Any, b: Any, within: float, what: str) -> None:
    if a is None or b is None or isinstance(a, int) and isinstance(b, int) and within == 0:
        assert a == b, what
    else:
        assert abs(float(a) - float(b)) <= within, f"{what}: {a} vs {b}"


def compare_replies(plan: Plan, batched: list[Any], single: list[Any], elapsed: float) -> None:
    assert len(batched) == len(single) == len(plan.batch)
    for i, (call, b, s) in enumerate(zip(plan.batch, batched, single)):
        what = f"call {i} {call[:2]}"
        if call[0] == "c":
            assert b == s, what
            continue
        assert len(b) == len(s), what
        assert b[0] == s[0] and b[2] == s[2], what  # allowed, day
        close(b[3], s[3], 0, what + " share")
        for j in range(4, len(b), 4):
            close(b[j], s[j], SLOW * elapsed, what + " requests")
            close(b[j + 1], s[j + 1], SLOW * elapsed, what + " tokens")
            assert b[j + 2 : j + 4] == s[j + 2 : j + 4], what  # live leases, tokens used today


def compare_states(batched: dict[str, Any], single: dict[str, Any], elapsed: float) -> None:
    assert batched.keys() == single.keys()
    for key, (kind, b, b_ttl) in batched.items():
        s_kind, s, s_ttl = single[key]
        assert kind == s_kind, key
        assert (b_ttl > 0) == (s_ttl > 0), f"{key}: ttl {b_ttl} vs {s_ttl}"
        close(b_ttl, s_ttl, 2000 * elapsed + 2000, f"{key} ttl")
        if kind == "zset":
            assert b.keys() == s.keys(), key
            for member in b:
                close(b[member], s[member], elapsed, f"{key} {member}")
        elif kind == "hash":
            assert b.keys() == s.keys(), key
            for field in b:
                exact = field in ("day", "used", "demand", "s")
                # per second of clock difference: refill of the levels, ms of an expiry (and 1 ms: rounded up)
                within = {"r": SLOW, "t": SLOW, "x": 2000}.get(field, 1.0) * elapsed + (field == "x")
                close(b[field], s[field], 0 if exact else within, f"{key} {field}")
        else:
            assert b == s, key


@pytest.mark.parametrize("seed", range(24))
def test_a_batch_does_what_the_single_scripts_do_one_after_the_other(seed):
    plan = Plan(seed)
    run_id = uuid.uuid4().hex
    batched_prefix, single_prefix = f"tftest:quota:{run_id}b:", f"tftest:quota:{run_id}s:"
    client = redis.Redis.from_url(REDIS_URL)
    try:
        start = time.monotonic()
        batched = run(apply(batched_prefix, plan, batched=True))
        single = run(apply(single_prefix, plan, batched=False))
        elapsed = time.monotonic() - start  # the most the two runs' clocks can differ by
        compare_replies(plan, batched, single, elapsed)
        compare_states(state(client, batched_prefix), state(client, single_prefix), elapsed)
        assert any(r[0] == 1 for r, call in zip(batched, plan.batch) if call[0] == "r") or seed % 3  # (mostly) admits
    finally:
        for prefix in (batched_prefix, single_prefix):
            keys = list(client.scan_iter(match=prefix + "*", count=1000))
            if keys:
                client.delete(*keys)
        client.close()


def test_concurrent_reserves_and_reconciles_go_as_one_batch_call(prefix):
    """Through RedisQuota: a tick's reserves and reconciles are one call of the batch script, whose replies reach
    their callers; the admissions are exactly what the limits allow, in call order."""

    async def main():
        q = RedisQuota.from_url(REDIS_URL, prefix)
        try:
            scopes = [Scope("org:acme", "acme", Limits(concurrent_requests=5, tokens_per_minute=10_000))]
            decisions = await asyncio.gather(*(q.reserve(f"r{i}", scopes, 100) for i in range(12)))
            assert [d.allowed for d in decisions] == [True] * 5 + [False] * 7
            assert {d.reason for d in decisions[5:]} == {"concurrent_requests"}
            assert [d.headers["x-ratelimit-remaining-tokens"] for d in decisions[:5]] == [
                str(10_000 - 100 * (i + 1)) for i in range(5)
            ]
            batches = q.store.batcher.batches
            admitted = [d.reservation for d in decisions[:5]]
            both = await asyncio.gather(
                *(q.reconcile(r, 50) for r in admitted[:3]), *(q.reserve(f"s{i}", scopes, 10) for i in range(4))
            )
            assert q.store.batcher.batches == batches + 1
            assert [d.allowed for d in both[3:]] == [True, True, True, False]  # the reconciles freed 3 slots first
            left = await q.remaining(scopes[0])
            assert left.concurrent == 0 and 10_000 - 500 + 150 - 30 <= left.tokens < 10_000 - 500 + 150 - 30 + 5
        finally:
            await q.close()

    run(main())


def test_a_call_whose_key_has_the_wrong_type_fails_alone_in_its_batch(prefix):
    """A key that is not what the scripts wrote (here a string where a scope's hash belongs) fails the calls that
    read it, as their single scripts would; the other calls of the batch get their answers."""
    client = redis.Redis.from_url(REDIS_URL)
    client.set(f"{prefix}{{broken}}:org:broken:q", "not a hash")

    async def main():
        q = RedisQuota.from_url(REDIS_URL, prefix)
        try:
            fine = Scope("org:acme", "acme", Limits(tokens_per_minute=1000, concurrent_requests=10))
            broken = Scope("org:broken", "broken", Limits(tokens_per_minute=1000))
            replies = await asyncio.gather(
                q.reserve("a0", [fine], 10),
                q.reserve("b0", [broken], 10),
                q.reserve("a1", [fine], 10),
                return_exceptions=True,
            )
            assert q.store.batcher.batches == 1
            assert replies[0].allowed and replies[2].allowed
            assert isinstance(replies[1], redis.exceptions.ResponseError) and "WRONGTYPE" in str(replies[1])
            assert (await q.remaining(fine)).concurrent == 8
        finally:
            await q.close()

    run(main())
    client.close()


def test_a_batch_call_packs_every_calls_keys_then_every_calls_kind_and_arguments():
    script, batch = Script("return 1"), Script("return 2")
    template = OpTemplate.of(script, batch, "c", ["k1", "k2é"], 1, 3, ["900.0", 2, "0", -1, 6000])
    one, two = template.call("m1", "rid-ü", -5, 20425), template.call("m2", "r2", 7, 20426)
    args = ["900.0", 2, "0", -1, 6000]
    assert one.packed() == ScriptCall(script, ["k1", "k2é", "m1"], ["rid-ü", -5, 20425, *args]).packed()
    keys = ["k1", "k2é", "m1", "k1", "k2é", "m2"]
    plain = ScriptCall(batch, keys, ["c", "rid-ü", -5, 20425, *args, "c", "r2", 7, 20426, *args])
    call = BatchCall(batch, [one, two])
    assert call.packed() == plain.packed() and call.packed(by_sha=False) == plain.packed(by_sha=False)
