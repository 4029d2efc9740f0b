"""Batched round trips: the quota's script calls made within one event-loop tick reach Redis in one write on one
connection (up to MAX_BATCH; more go out as several writes at once), and each caller still gets its own answer with
the semantics of a call sent alone. Writes are counted by a connection class that wraps redis-py's; the coalescing
logic itself is tested on the batcher alone."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from tests.quota.helpers import REDIS_URL, org, run, user
from tokenfleet.quota import QuotaStoreError, RedisQuota
from tokenfleet.quota.batcher import TickBatcher
from tokenfleet.quota.redis import BATCH, RECONCILE, RESERVE
from tokenfleet.quota.redis_client import MAX_BATCH, Script


class CountingConnection(aioredis.Connection):
    writes: list[int] = []  # script calls per write, over every connection of the test
    made: list[CountingConnection] = []

    def __init__(self, **options) -> None:
        super().__init__(**options)
        CountingConnection.made.append(self)

    async def send_packed_command(self, command, check_health: bool = True) -> None:
        data = command if isinstance(command, bytes) else b"".join(command)
        scripts = data.count(b"\r\n$7\r\nEVALSHA\r\n") + data.count(b"\r\n$4\r\nEVAL\r\n")
        if scripts:  # not the handshake of a new connection
            CountingConnection.writes.append(scripts)
        await super().send_packed_command(command, check_health)


def counted_quota(prefix: str, **options) -> RedisQuota:
    """A RedisQuota whose writes are counted, its scripts known to Redis already (a first call of a script Redis has
    not seen costs a second write: test_one_failing_script_does_not_fail_the_others_in_its_write)."""
    sync = redis.Redis.from_url(REDIS_URL)
    for script in (RESERVE, RECONCILE, BATCH):
        sync.script_load(script.source)
    sync.close()
    CountingConnection.writes, CountingConnection.made = [], []
    pool = aioredis.BlockingConnectionPool.from_url(
        REDIS_URL, max_connections=16, timeout=None, connection_class=CountingConnection
    )
    return RedisQuota(aioredis.Redis(connection_pool=pool), prefix, owns_client=True, **options)


def test_concurrent_reserves_share_one_write_and_keep_their_own_answers(prefix):
    async def main():
        quota = counted_quota(prefix)
        try:
            scopes = [org(concurrent_requests=7, tokens_per_minute=1_000_000), user(tokens_per_minute=1_000_000)]
            decisions = await asyncio.gather(*(quota.reserve(f"r{i}", scopes, 10 + i) for i in range(MAX_BATCH)))
            assert CountingConnection.writes == [1]  # one round trip, one call of the batch script, 32 decisions
            admitted = [d for d in decisions if d.allowed]
            assert len(admitted) == 7  # each script is still atomic on its own: exactly the limit
            assert [d.reservation.request_id for d in admitted] == [f"r{i}" for i in range(7)]  # in arrival order
            assert [d.reservation.tokens for d in admitted] == [10 + i for i in range(7)]
            assert {d.reason for d in decisions if not d.allowed} == {"concurrent_requests"}

            CountingConnection.writes.clear()
            await asyncio.gather(*(quota.reconcile(d.reservation, 5) for d in admitted))
            assert CountingConnection.writes == [1]
            assert (await quota.remaining(scopes[0])).concurrent == 7  # every slot freed
        finally:
            await quota.close()

    run(main())


def test_a_tick_beyond_one_write_goes_out_as_several_writes_at_once(prefix):
    async def main():
        quota = counted_quota(prefix)
        try:
            scopes = [org(concurrent_requests=100), user(tokens_per_minute=1_000_000)]
            decisions = await asyncio.gather(*(quota.reserve(f"r{i}", scopes, 1) for i in range(2 * MAX_BATCH + 1)))
            assert CountingConnection.writes == [1, 1, 1]  # 32, 32 (batch script calls) and 1 (RESERVE)
            assert len(CountingConnection.made) == 3  # in flight together, one connection each
            assert all(d.allowed for d in decisions)
            assert [d.reservation.request_id for d in decisions] == [f"r{i}" for i in range(2 * MAX_BATCH + 1)]
            assert (await quota.remaining(scopes[0])).concurrent == 100 - 2 * MAX_BATCH - 1
        finally:
            await quota.close()

    run(main())


def test_calls_of_different_ticks_go_in_different_writes(prefix):
    async def main():
        quota = counted_quota(prefix)
        try:
            for i in range(3):
                assert (await quota.reserve(f"r{i}", [org(tokens_per_minute=1000)], 10)).allowed
            assert CountingConnection.writes == [1, 1, 1]  # a lone call waits for no one
        finally:
            await quota.close()

    run(main())


def test_batches_keep_their_connections_and_close_them_with_the_quota(prefix):
    async def main():
        quota = counted_quota(prefix)
        try:
            for i in range(5):
                assert (await quota.reserve(f"r{i}", [org(tokens_per_minute=1000)], 10)).allowed
            await asyncio.gather(*(quota.reserve(f"b{i}", [org(tokens_per_minute=1000)], 1) for i in range(300)))
            assert len(CountingConnection.made) == 10  # one batch at a time, then 9 x 32 + 12 at once
            assert all(c.is_connected for c in CountingConnection.made)
        finally:
            await quota.close()
        assert not any(c.is_connected for c in CountingConnection.made)

    run(main())


def test_one_failing_script_does_not_fail_the_others_in_its_write(prefix):
    async def main():
        quota = counted_quota(prefix)
        try:
            boom = Script(f"return redis.error_reply('boom {uuid.uuid4().hex}')")
            fresh = Script(f"return 'fresh' -- {uuid.uuid4().hex}")  # unknown to Redis: NOSCRIPT, then EVAL
            replies = await asyncio.gather(
                quota.store.run(boom, [], []),
                quota.store.run(fresh, [], []),
                quota.reserve("r0", [org(tokens_per_minute=1000)], 10),
                return_exceptions=True,
            )
            assert isinstance(replies[0], ResponseError) and "boom" in str(replies[0])
            assert replies[1] == b"fresh"
            assert replies[2].allowed
            assert CountingConnection.writes == [3, 2]  # the two unknown scripts sent again with their source
            assert await quota.store.run(fresh, [], []) == b"fresh"
            assert CountingConnection.writes[-1] == 1  # cached now: EVALSHA alone
        finally:
            await quota.close()

    run(main())


def test_a_caller_cancelled_before_its_write_is_left_out(prefix):
    async def main():
        quota = counted_quota(prefix)
        try:
            scope = org(concurrent_requests=1)
            gone = asyncio.ensure_future(quota.reserve("gone", [scope], 1))
            kept = asyncio.ensure_future(quota.reserve("kept", [scope], 1))
            await asyncio.sleep(0)  # both queued their calls
            gone.cancel()
            assert (await kept).allowed  # the only slot: the cancelled call never reached Redis
            assert CountingConnection.writes == [1]
            with pytest.raises(asyncio.CancelledError):
                await gone
        finally:
            await quota.close()

    run(main())


def test_every_call_of_a_write_that_cannot_reach_redis_fails_as_an_outage(prefix):
    async def main():
        quota = RedisQuota.from_url("redis://127.0.0.1:1", prefix)  # nothing listens on port 1
        try:
            results = await asyncio.gather(
                *(quota.reserve(f"r{i}", [org(tokens_per_minute=100)], 1) for i in range(10)), return_exceptions=True
            )
            assert all(isinstance(r, QuotaStoreError) for r in results)
            assert len({id(r) for r in results}) == 10  # each caller its own exception
        finally:
            await quota.close()

    run(main())


def test_batcher_coalesces_one_tick_and_splits_at_max_batch():
    async def main():
        seen: list[list[int]] = []

        async def flush(items: list[int]) -> list[object]:
            seen.append(items)
            await asyncio.sleep(0)
            return [ValueError(i) if i == 3 else i * 10 for i in items]

        batcher: TickBatcher[int] = TickBatcher(flush, max_batch=4)
        futures = [batcher.submit(i) for i in range(6)]
        answers = await asyncio.gather(*futures, return_exceptions=True)
        assert seen == [[0, 1, 2, 3], [4, 5]]
        assert answers[:3] == [0, 10, 20] and isinstance(answers[3], ValueError) and answers[4:] == [40, 50]
        assert await batcher.submit(7) == 70  # the next tick: a batch of its own
        assert seen[-1] == [7] and batcher.batches == 3

    run(main())


def test_batcher_gives_a_failed_flush_to_every_caller():
    async def main():
        async def flush(items: list[int]) -> list[object]:
            raise ConnectionError("down")

        async def short(items: list[int]) -> list[object]:
            return items[:1]

        batcher: TickBatcher[int] = TickBatcher(flush)
        results = await asyncio.gather(batcher.submit(1), batcher.submit(2), return_exceptions=True)
        assert [type(r) for r in results] == [ConnectionError, ConnectionError]
        wrong: TickBatcher[int] = TickBatcher(short)
        results = await asyncio.gather(wrong.submit(1), wrong.submit(2), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results)  # an answer per call, or none at all

    run(main())
