"""Redis failing under load, in a fleet (a gateway process in front of a replica process, PostgreSQL, and a Redis of
the test's own that it kills and restarts). Paid users are admitted during a quota outage (the tier's default), so
every completion must still be served, metered once and released, and every stream must end properly."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest
import redis

from tests.chaos.harness import (
    RedisProcess,
    chaos_fleet,
    check_every_request_metered,
    check_metered,
    check_no_relay_left,
    check_responses,
    in_background,
    in_threads,
    plain_completion,
    stream_completion,
    wait_for,
)
from tests.metering.helpers import events, eventually, row_counts
from tests.store.backends import create_postgres_database, database_url, drop_postgres_database
from tokenfleet.metering import Outbox, OutboxShipper, RedisStreamLog, WarehouseWriter
from tokenfleet.store.db import Database

PREFIX = "chaos:"  # Redis is the test's own: no other test shares its keys


@pytest.fixture(scope="module")
def fleet(demo_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("redis-outage")
    with chaos_fleet(
        demo_model_dir, logs, redis_prefix=PREFIX + "stream:", metering={"stream_key": PREFIX + "usage"}
    ) as fleet:
        yield fleet


@pytest.fixture
def gateway(fleet):
    """A fresh gateway per test, over a running Redis."""
    if fleet.redis.process.poll() is not None:
        fleet.redis.start()
    with fleet.gateway():
        yield fleet


def resume(fleet, key: str, request_id: str, last_id: int = 0) -> httpx.Response:
    return httpx.get(
        f"{fleet.base}/v1/requests/{request_id}/stream",
        timeout=30,
        headers={"Authorization": f"Bearer {key}", "Last-Event-ID": str(last_id)},
    )


def test_requests_while_redis_is_down_are_served_metered_and_released(gateway):
    fleet = gateway
    key = fleet.new_key()
    before = stream_completion(fleet.base, key, 10)
    fleet.redis.kill()
    during = in_threads(
        *[lambda: stream_completion(fleet.base, key, 30)] * 3, *[lambda: plain_completion(fleet.base, key, 20)] * 2
    )
    after = stream_completion(fleet.base, key, 30)
    refused = resume(fleet, key, f"chatcmpl-{uuid.uuid4().hex}")
    check_no_relay_left(fleet)
    fleet.redis.start()
    check_every_request_metered(fleet, key, sent=7)
    check_responses([*during, after])
    assert [o.status for o in [*during, after]] == [200] * 6, [o.describe() for o in [*during, after]]
    for stream in [*during[:3], after]:
        assert stream.events[-1][2] == "[DONE]" and stream.delivered == 30, stream.describe()
    # a stream started once the gateway has seen Redis fail says it cannot be resumed elsewhere (those that raced the
    # failure may not have known it when their headers went: the first token does not wait for Redis's answers)
    assert after.headers.get("x-tokenfleet-resume") == "unavailable", after.describe()
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable", refused.text
    check_metered(fleet, [before, *during, after])


def test_streams_in_flight_when_redis_dies_end_properly(gateway):
    fleet = gateway
    key = fleet.new_key()
    long_streams = in_background(*[lambda: stream_completion(fleet.base, key, 400)] * 4)
    wait_for(lambda: fleet.active_relays() == 4, "the long streams to start")
    time.sleep(0.5)
    fleet.redis.kill()
    during = in_threads(lambda: stream_completion(fleet.base, key, 20), lambda: plain_completion(fleet.base, key, 20))
    in_flight = long_streams()
    check_responses(in_flight + during)
    assert all(o.status == 200 for o in in_flight + during), [o.describe() for o in in_flight + during]
    assert all(o.events[-1][2] == "[DONE]" and o.delivered == 400 for o in in_flight), (
        "a stream in flight did not go on to its end without Redis"
    )
    check_no_relay_left(fleet)
    fleet.redis.start()
    check_every_request_metered(fleet, key, sent=6)
    check_metered(fleet, in_flight + during)


def test_the_first_requests_after_a_redis_restart_are_resumable(gateway):
    """Pooled connections to the old Redis are reconnected on first use, not failed."""
    fleet = gateway
    key = fleet.new_key()
    warm = in_threads(*[lambda: stream_completion(fleet.base, key, 30)] * 6)  # several pooled connections
    fleet.redis.kill()
    fleet.redis.start()
    after = in_threads(*[lambda: stream_completion(fleet.base, key, 20)] * 6)
    check_responses(warm + after)
    assert [o.headers.get("x-tokenfleet-resume") for o in after] == [None] * 6, [o.describe() for o in after]
    client = redis.Redis(port=fleet.redis.port)
    try:
        assert all(client.exists(f"{PREFIX}stream:{o.request_id}") for o in after), "a stream is not in Redis"
    finally:
        client.close()
    check_no_relay_left(fleet)
    check_every_request_metered(fleet, key, sent=12)
    check_metered(fleet, warm + after)


# --- the usage pipeline alone -------------------------------------------------------------------------------------


def test_usage_events_the_event_log_lost_in_a_restart_are_shipped_again(tmp_path):
    """Shipped (marked sent) but not yet written when Redis restarted without its data: the shipper must send them
    again, and must not purge them before the warehouse has them."""
    redis_server = RedisProcess(tmp_path)
    redis_server.start()
    database = create_postgres_database()
    try:
        asyncio.run(_ship_across_a_restart(redis_server, database_url(database)))
    finally:
        redis_server.stop()
        drop_postgres_database(database)


async def _ship_across_a_restart(redis_server: RedisProcess, url: str) -> None:
    async with Database(url) as db:
        await db.migrate()
        outbox = Outbox(db)
        for event in events(20):
            await outbox.add(event)
        stream_log = RedisStreamLog.from_url(redis_server.url, PREFIX + "usage", claim_idle_ms=500)
        shipper = OutboxShipper(
            outbox, stream_log, interval_s=0.05, max_backoff_s=0.2, keep_sent_s=0.1, reship_after_s=1.0
        )
        assert await shipper.ship_once() == 20  # in the stream, marked sent; no writer has read them yet
        redis_server.kill()
        redis_server.start()  # empty: the 20 events are gone from the log
        writer = WarehouseWriter(db, stream_log, "writer", block_ms=50, max_backoff_s=0.2)
        loops = [asyncio.create_task(shipper.run()), asyncio.create_task(writer.run())]
        try:

            async def all_written() -> bool:
                return len(await row_counts(db)) == 20

            await eventually(all_written, timeout_s=15, what="the lost events to reach the warehouse")
        finally:
            for loop in loops:
                loop.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await stream_log.close()
        assert set((await row_counts(db)).values()) == {1}
