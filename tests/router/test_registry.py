"""The replica registry against a real Redis: announce, heartbeat expiry (a kill -9), withdraw, draining, watch
events, Redis outages; and real `tokenfleet replica --register` processes joining and leaving."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from tests.gateway.conftest import replica_args
from tests.servers import delete_redis_keys, free_port, wait_healthy
from tokenfleet.cli import build_parser
from tokenfleet.commands.replica import default_advertise_url, registration_from_args
from tokenfleet.router.registry import RegistryKeys, ReplicaAnnouncer, ReplicaRecord, ReplicaRegistry

REDIS_URL = "redis://127.0.0.1:6379"
DEAD_REDIS_URL = f"redis://127.0.0.1:{free_port()}"  # nothing listens there
TTL_S, BEAT_S = 1.0, 0.25


@pytest.fixture
def prefix():
    prefix = f"tftest:replicas:{uuid.uuid4().hex}:"
    yield prefix
    delete_redis_keys(prefix)


def record(name: str = "10.0.0.1:8100", **fields) -> ReplicaRecord:
    return ReplicaRecord(name=name, url=f"http://{name}", model="demo-2026-10-01", started_at=time.time(), **fields)


def announcer(client, prefix: str, rec: ReplicaRecord | None = None) -> ReplicaAnnouncer:
    return ReplicaAnnouncer(client, rec or record(), prefix, ttl_s=TTL_S, heartbeat_s=BEAT_S)


async def eventually(check, timeout: float, interval: float = 0.02):
    """Awaits `check()` (sync or async) until it is truthy; returns it, or fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value or time.monotonic() > deadline:
            assert value, f"not true within {timeout}s"
            return value
        await asyncio.sleep(interval)


async def stop(*tasks: asyncio.Task) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class Events:
    """Collects watch() callbacks as (monotonic time, joined, left)."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, list[ReplicaRecord], list[ReplicaRecord]]] = []

    async def __call__(self, joined: list[ReplicaRecord], left: list[ReplicaRecord]) -> None:
        self.calls.append((time.monotonic(), joined, left))

    def joined(self) -> list[ReplicaRecord]:
        return [r for _, joined, _ in self.calls for r in joined]

    def left(self) -> list[ReplicaRecord]:
        return [r for _, _, left in self.calls for r in left]


def test_announce_appears_within_one_poll_and_watch_reports_the_join(prefix):
    async def main():
        client = aioredis.from_url(REDIS_URL)
        registry, events = ReplicaRegistry(client, prefix, poll_s=0.5), Events()
        watching = asyncio.create_task(registry.watch(events))
        await asyncio.sleep(0.1)  # the watch has polled once and found nothing
        rec = record()
        started = time.monotonic()
        beating = asyncio.create_task(announcer(client, prefix, rec).run())
        await eventually(lambda: events.calls, timeout=0.5)
        assert events.calls[0][0] - started < 0.5
        assert events.calls == [(events.calls[0][0], [rec], [])]
        assert await registry.snapshot() == [rec] and registry.known == {rec.name: rec}
        await stop(beating, watching)
        await client.aclose()

    asyncio.run(main())


def test_a_replica_whose_heartbeat_stops_expires_within_ttl_and_its_keys_go(prefix):
    async def main():
        client = aioredis.from_url(REDIS_URL)
        registry, events = ReplicaRegistry(client, prefix, poll_s=0.1), Events()
        watching = asyncio.create_task(registry.watch(events))
        beating = asyncio.create_task(announcer(client, prefix).run())
        await eventually(registry.snapshot, timeout=1)
        await stop(beating)  # like kill -9: no withdraw
        died = time.monotonic()
        assert await registry.snapshot(), "nobody deleted it: it is still live until it expires"
        await eventually(lambda: events.left(), timeout=TTL_S + 0.5)
        assert TTL_S - BEAT_S - 0.1 < time.monotonic() - died < TTL_S + 0.5
        assert await registry.snapshot() == []
        # nothing beats any more: the keys themselves expire (2 x ttl after the last heartbeat)
        await eventually(lambda: _no_keys(client, prefix), timeout=2 * TTL_S + 0.5, interval=0.1)
        await stop(watching)
        await client.aclose()

    asyncio.run(main())


async def _no_keys(client, prefix: str) -> bool:
    return not await client.keys(prefix + "*")


def test_expired_records_are_reaped_by_other_replicas_heartbeats(prefix):
    async def main():
        client = aioredis.from_url(REDIS_URL)
        keys = RegistryKeys.under(prefix)
        dead = announcer(client, prefix, record("10.0.0.1:8100"))
        assert await dead.beat()
        alive = asyncio.create_task(announcer(client, prefix, record("10.0.0.2:8100")).run())
        await asyncio.sleep(TTL_S + 2 * BEAT_S)
        assert await client.hkeys(keys.records) == [b"10.0.0.2:8100"]
        assert await client.zrange(keys.live, 0, -1) == [b"10.0.0.2:8100"]
        assert 0 < await client.pttl(keys.records) <= 2000 * TTL_S
        await stop(alive)
        await client.aclose()

    asyncio.run(main())


def test_withdraw_removes_the_record_at_once_and_stops_heartbeats(prefix):
    async def main():
        client = aioredis.from_url(REDIS_URL)
        registry, events = ReplicaRegistry(client, prefix, poll_s=5.0), Events()  # only a notification is quick
        rec = record()
        replica = announcer(client, prefix, rec)
        beating = asyncio.create_task(replica.run())
        watching = asyncio.create_task(registry.watch(events))
        await eventually(lambda: events.joined(), timeout=1)
        assert await replica.withdraw()
        assert await registry.snapshot() == []
        await eventually(lambda: events.left() == [rec], timeout=0.5)
        await asyncio.wait_for(beating, 1)  # run() returns once withdrawn
        assert not await replica.beat() and await registry.snapshot() == []
        await stop(watching)
        await client.aclose()

    asyncio.run(main())


def test_draining_is_visible_at_once_and_kept_by_later_heartbeats(prefix):
    async def main():
        client = aioredis.from_url(REDIS_URL)
        registry, events = ReplicaRegistry(client, prefix, poll_s=5.0), Events()
        rec = record(pool="eu-west")
        replica = announcer(client, prefix, rec)
        beating = asyncio.create_task(replica.run())
        watching = asyncio.create_task(registry.watch(events))
        await eventually(lambda: events.joined(), timeout=1)
        assert await replica.set_draining()
        draining = ReplicaRecord(**{**rec.__dict__, "draining": True})
        assert await registry.snapshot() == [draining]
        # a changed record is reported as left (old) + joined (new) in one call
        await eventually(lambda: len(events.calls) == 2, timeout=0.5)
        assert events.calls[1][1:] == ([draining], [rec])
        await asyncio.sleep(3 * BEAT_S)
        assert await registry.snapshot() == [draining]
        await stop(beating, watching)
        await client.aclose()

    asyncio.run(main())


def test_a_withdraw_never_removes_a_newer_instance_under_the_same_name(prefix):
    async def main():
        client = aioredis.from_url(REDIS_URL)
        registry = ReplicaRegistry(client, prefix)
        old, new = announcer(client, prefix, record()), announcer(client, prefix, record())
        assert await old.beat() and await new.beat()
        await old.withdraw()
        assert await registry.snapshot() == [new.record]
        await client.aclose()

    asyncio.run(main())


def test_watch_survives_a_failing_callback_and_accepts_plain_functions(prefix):
    async def main():
        client = aioredis.from_url(REDIS_URL)
        registry, seen = ReplicaRegistry(client, prefix, poll_s=0.05), []

        def on_change(joined, left):
            seen.append((joined, left))
            raise RuntimeError("a bug in the gateway's callback")

        watching = asyncio.create_task(registry.watch(on_change))
        first, second = announcer(client, prefix, record("a:1")), announcer(client, prefix, record("b:1"))
        assert await first.beat()
        await eventually(lambda: len(seen) == 1, timeout=1)
        assert await second.beat()
        await eventually(lambda: len(seen) == 2, timeout=1)
        assert seen[1] == ([second.record], []) and not watching.done()
        await stop(watching)
        await client.aclose()

    asyncio.run(main())


def test_a_redis_outage_never_raises_out_of_the_loops(prefix, caplog):
    async def main():
        dead = aioredis.from_url(DEAD_REDIS_URL)
        replica = ReplicaAnnouncer(dead, record(), prefix, ttl_s=TTL_S, heartbeat_s=BEAT_S)
        registry, events = ReplicaRegistry(dead, prefix, poll_s=0.1), Events()
        loops = [asyncio.create_task(replica.run()), asyncio.create_task(registry.watch(events))]
        await asyncio.sleep(1.0)
        assert not any(task.done() for task in loops)
        assert not await replica.set_draining() and not await replica.withdraw()
        with pytest.raises(redis.exceptions.ConnectionError):
            await registry.snapshot()  # a direct snapshot reports the outage to its caller
        assert events.calls == []
        await stop(*loops)
        await dead.aclose()

    asyncio.run(main())
    assert "Redis unreachable" in caplog.text


def test_the_watch_keeps_the_last_known_set_through_an_outage(prefix):
    async def main():
        client, dead = aioredis.from_url(REDIS_URL), aioredis.from_url(DEAD_REDIS_URL)
        registry, events = ReplicaRegistry(client, prefix, poll_s=0.05), Events()
        beating = asyncio.create_task(announcer(client, prefix).run())
        watching = asyncio.create_task(registry.watch(events))
        await eventually(lambda: registry.known, timeout=1)
        known = dict(registry.known)
        registry.redis = dead  # the gateway loses Redis; the replica keeps beating
        await asyncio.sleep(0.5)
        assert registry.known == known and events.left() == [] and not watching.done()
        registry.redis = client
        await asyncio.sleep(0.3)
        assert registry.known == known and len(events.calls) == 1
        await stop(beating, watching)
        await client.aclose()
        await dead.aclose()

    asyncio.run(main())


def test_replica_flags_and_the_advertised_url():
    assert default_advertise_url("10.1.2.3", 8100) == "http://10.1.2.3:8100"
    assert default_advertise_url("::1", 8100) == "http://[::1]:8100"
    wildcard = default_advertise_url("0.0.0.0", 8100)
    assert wildcard.startswith("http://") and wildcard.endswith(":8100") and "0.0.0.0" not in wildcard
    args = build_parser().parse_args(
        [
            "replica",
            "--model",
            "m",
            "--port",
            "8101",
            "--register",
            REDIS_URL,
            "--advertise-url",
            "http://replica-7.fleet:8101/",
            "--pool",
            "eu-west",
        ]
    )
    registration = registration_from_args(args, "demo-2026-10-01")
    assert registration.record.name == "replica-7.fleet:8101"
    assert registration.record.url == "http://replica-7.fleet:8101"
    assert registration.record.pool == "eu-west" and registration.record.model == "demo-2026-10-01"
    assert registration.prefix == "tokenfleet:replicas:" and registration.ttl_s == 6.0
    assert registration.health_url == "http://127.0.0.1:8101/health"


# --- real replica processes -------------------------------------------------------------------------------------


def snapshot(prefix: str) -> dict[str, ReplicaRecord]:
    async def read():
        client = aioredis.from_url(REDIS_URL)
        try:
            return {r.name: r for r in await ReplicaRegistry(client, prefix).snapshot()}
        finally:
            await client.aclose()

    return asyncio.run(read())


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.02)
    return value


@contextmanager
def spawn(args: list[str], log_path: Path):
    """Starts `python -m tokenfleet ARGS` without waiting, so several can load their models at once."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokenfleet", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def hold_open_request(port: int) -> tuple[socket.socket, bytes]:
    """Sends a completion request's headers and half its body: the request is in flight until the rest is sent."""
    body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 4}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body[:10])
    return sock, body[10:]


def read_response(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_replica_processes_join_expire_when_killed_and_drain_then_withdraw_on_sigterm(demo_model_dir, prefix, tmp_path):
    ports = [free_port(), free_port()]
    names = [f"127.0.0.1:{p}" for p in ports]
    extra = ["--register", REDIS_URL, "--registry-prefix", prefix, "--registry-ttl", str(TTL_S)]
    with ExitStack() as stack:
        killed, termed = (
            stack.enter_context(spawn(replica_args(demo_model_dir, p) + extra, tmp_path / f"{p}.log")) for p in ports
        )
        for proc, port in zip((killed, termed), ports):
            wait_healthy(proc, f"http://127.0.0.1:{port}/health", tmp_path / f"{port}.log", 120)
        live = wait_for(lambda: len(snapshot(prefix)) == 2 and snapshot(prefix), 5, "both replicas registered")
        for name in names:
            assert live[name].url == f"http://{name}" and live[name].model == "tiny"
            assert live[name].pool == "default" and live[name].kind == "tokenfleet" and not live[name].draining

        killed.send_signal(signal.SIGKILL)
        died = time.monotonic()
        wait_for(lambda: names[0] not in snapshot(prefix), TTL_S + 0.5, "the killed replica expired")
        assert time.monotonic() - died > TTL_S / 2 and names[1] in snapshot(prefix)

        sock, rest = hold_open_request(ports[1])
        time.sleep(0.2)  # the server has the headers: the request is in flight
        termed.send_signal(signal.SIGTERM)
        wait_for(lambda: snapshot(prefix)[names[1]].draining, 2, "draining shown at the start of the drain")
        time.sleep(0.5)
        assert termed.poll() is None and snapshot(prefix)[names[1]].draining, "the drain waits for our request"
        sock.sendall(rest)
        response = read_response(sock)
        assert response.startswith(b"HTTP/1.1 200") and b'"choices"' in response
        wait_for(lambda: not snapshot(prefix), 5, "the drained replica withdrew")
        assert termed.wait(timeout=10) is not None
