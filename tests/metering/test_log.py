"""The event log contract, for MemoryLog and RedisStreamLog alike: order, ack, blocking reads, consumers sharing
the work, and redelivery of entries a dead consumer read but never acked. Then what only Redis has: a restarted
consumer name, a lost consumer group, undecodable entries and the length cap."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from tests.metering.helpers import REDIS_URL, event, events
from tokenfleet.metering import MemoryLog, RedisStreamLog

pytestmark = pytest.mark.anyio


def ids_of(entries) -> list[str]:
    return [e.request_id for _, e in entries]


async def test_published_events_are_read_in_order_and_acked_ones_never_return(make_log):
    log = make_log(claim_idle_ms=50)
    published = await log.publish(events(5))
    assert len(set(published)) == 5
    first = await log.read("w1", count=3, block_ms=0)
    assert ids_of(first) == ids_of([(None, e) for e in events(3)])
    assert [entry_id for entry_id, _ in first] == published[:3]
    await log.ack([entry_id for entry_id, _ in first])
    rest = await log.read("w1", count=10, block_ms=0)
    assert [e for _, e in rest] == events(5)[3:]
    await log.ack([entry_id for entry_id, _ in rest])
    await asyncio.sleep(0.1)  # past the claim time: nothing un-acked is left to come back
    assert await log.read("w2", count=10, block_ms=0) == []


async def test_an_empty_read_waits_block_ms_then_a_publish_wakes_it(make_log):
    log = make_log()
    began = time.monotonic()
    assert await log.read("w", count=10, block_ms=150) == []
    assert 0.12 < time.monotonic() - began < 1.0
    reader = asyncio.create_task(log.read("w", count=10, block_ms=5000))
    await asyncio.sleep(0.05)
    began = time.monotonic()
    await log.publish([event(1)])
    assert ids_of(await reader) == [event(1).request_id]
    assert time.monotonic() - began < 1.0


async def test_consumers_share_the_entries_without_overlap(make_log):
    log = make_log()
    await log.publish(events(10))
    a = await log.read("a", count=4, block_ms=0)
    b = await log.read("b", count=10, block_ms=0)
    assert len(a) == 4 and len(b) == 6
    assert sorted(ids_of(a) + ids_of(b)) == sorted(e.request_id for e in events(10))


async def test_entries_a_dead_consumer_left_unacked_go_to_another_after_the_idle_time(make_log):
    log = make_log(claim_idle_ms=200)
    await log.publish(events(3))
    taken = await log.read("dead", count=10, block_ms=0)  # read, then "crash": never acked
    assert len(taken) == 3
    assert await log.read("alive", count=10, block_ms=0) == []  # not idle long enough yet
    await asyncio.sleep(0.25)
    claimed = await log.read("alive", count=10, block_ms=0)
    assert sorted(claimed) == sorted(taken)  # same entry ids, same events
    await log.ack([entry_id for entry_id, _ in claimed])
    await asyncio.sleep(0.25)
    assert await log.read("third", count=10, block_ms=0) == []


async def test_only_usage_events_are_published_and_reads_are_checked(make_log):
    log = make_log()
    with pytest.raises(ValueError, match="only UsageEvent can be published"):
        await log.publish([event(1).to_dict()])
    with pytest.raises(ValueError, match="count must be at least 1"):
        await log.read("w", count=0)
    assert await log.publish([]) == []
    await log.ack([])
    assert await log.read("w", count=5, block_ms=0) == []


@pytest.mark.parametrize("kind", [MemoryLog, RedisStreamLog])
def test_bad_settings_are_refused(kind):
    with pytest.raises(ValueError, match="must be positive"):
        kind(None, maxlen=0) if kind is RedisStreamLog else kind(maxlen=0)


async def test_memory_log_keeps_at_most_maxlen_entries():
    log = MemoryLog(maxlen=3)
    await log.publish(events(5))
    assert [e for _, e in await log.read("w", count=10, block_ms=0)] == events(5)[2:]


# Redis only


async def test_a_consumer_started_again_under_its_name_gets_its_unacked_entries_at_once(make_redis_log):
    before = make_redis_log()
    await before.publish(events(4))
    taken = await before.read("writer-1", count=10, block_ms=0)
    await before.close()  # the process dies without acking
    after = make_redis_log(claim_idle_ms=60_000)  # far longer than this test: no claim involved
    again = await after.read("writer-1", count=3, block_ms=0)
    again += await after.read("writer-1", count=3, block_ms=0)
    assert again == taken
    await after.ack([entry_id for entry_id, _ in again])
    await after.publish([event(9)])
    assert ids_of(await after.read("writer-1", count=10, block_ms=0)) == [event(9).request_id]


async def test_acked_entries_leave_the_stream_and_the_pending_list(make_redis_log, stream_key):
    log = make_redis_log()
    await log.publish(events(3))
    await log.ack([entry_id for entry_id, _ in await log.read("w", count=10, block_ms=0)])
    assert await log.redis.xlen(stream_key) == 0
    assert (await log.redis.xpending(stream_key, "warehouse"))["pending"] == 0


async def test_a_lost_consumer_group_is_made_again_and_reads_from_the_start(make_redis_log, stream_key):
    log = make_redis_log()
    await log.publish(events(2))
    await log.redis.xgroup_destroy(stream_key, "warehouse")  # as after a Redis restart without persistence
    assert [e for _, e in await log.read("w", count=10, block_ms=0)] == events(2)


async def test_entries_that_are_not_usage_events_are_dropped_and_acked(make_redis_log, stream_key, caplog):
    log = make_redis_log()
    await log.publish([event(1)])
    await log.redis.xadd(stream_key, {"event": "{not json"})
    await log.redis.xadd(stream_key, {"other": "field"})
    await log.publish([event(2)])
    got = await log.read("w", count=10, block_ms=0)
    assert ids_of(got) == [event(1).request_id, event(2).request_id]
    assert sum("dropping usage log entry" in r.getMessage() for r in caplog.records) == 2
    assert (await log.redis.xpending(stream_key, "warehouse"))["pending"] == 2  # just the two good ones


async def test_the_stream_is_capped_at_about_maxlen(make_redis_log, stream_key):
    log = make_redis_log(maxlen=100, delete_acked=False)
    for start in range(0, 1000, 100):
        await log.publish(events(100, first=start))
    assert 100 <= await log.redis.xlen(stream_key) < 400  # approximate trimming works in whole nodes


async def test_a_log_over_the_callers_client_leaves_it_open(stream_key):
    client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)  # longer than the reads' block_ms
    log = RedisStreamLog(client, stream_key, "g")
    try:
        assert await log.read("w", count=1, block_ms=50) == []
        await log.close()
        assert await client.ping()
    finally:
        await client.aclose()
