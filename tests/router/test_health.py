"""The router's per-replica circuit breaker: ejection, growing ejection times, half-open probes, slow-TTFT outliers,
the pool's ejection cap, and active /health checks against real HTTP servers."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from tests.servers import free_port
from tokenfleet.router.health import HealthSettings, HealthTracker


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def tracker(names=("a", "b", "c", "d"), **settings) -> tuple[HealthTracker, FakeClock]:
    clock = FakeClock()
    health = HealthTracker(HealthSettings(**settings), clock=clock)
    for name in names:
        health.add(name, None)
    return health, clock


def fail(health: HealthTracker, name: str, times: int, reason: str = "5xx") -> None:
    for _ in range(times):
        health.record_failure(name, reason)


# --- breaker logic, fake clock ----------------------------------------------------------------------------------


def test_consecutive_failures_eject_and_a_success_resets_the_count():
    health, _ = tracker(consecutive_failures=3)
    fail(health, "a", 2)
    health.record_success("a")
    fail(health, "a", 2, "connect")
    assert health.state("a") == "closed" and health.available("a")
    health.record_failure("a", "timeout")
    assert health.state("a") == "open"
    assert not health.available("a") and not health.begin_request("a")
    assert health.snapshot()["a"]["last_failure"] == "timeout"


def test_ejection_time_grows_with_each_ejection_and_is_capped():
    health, clock = tracker(consecutive_failures=1, base_ejection_s=5.0, max_ejection_multiplier=3)
    for expected in (5.0, 10.0, 15.0, 15.0):
        health.record_failure("a", "5xx")  # closed → open, or a failed probe: half_open → open
        assert health.state("a") == "open"
        assert health.snapshot()["a"]["ejected_for_s"] == expected
        clock.advance(expected - 0.01)
        assert health.state("a") == "open"
        clock.advance(0.01)
        assert health.state("a") == "half_open"


def test_time_spent_healthy_forgives_past_ejections():
    health, clock = tracker(consecutive_failures=1, base_ejection_s=5.0, ejection_decay_s=60.0)
    for _ in range(3):  # three ejections in a row, each probe failing
        health.record_failure("a", "5xx")
        clock.advance(30)
    assert health.begin_request("a")
    health.record_success("a")
    clock.advance(125)  # two decay periods healthy: 3 - 2 = 1 remembered ejection
    health.record_failure("a", "5xx")
    assert health.snapshot()["a"]["ejected_for_s"] == 10.0


def test_half_open_lets_exactly_one_probe_through_and_success_closes():
    health, clock = tracker(consecutive_failures=2, base_ejection_s=5.0)
    fail(health, "a", 2)
    clock.advance(5.0)
    assert health.state("a") == "half_open"
    assert health.available("a")  # asking takes nothing
    assert health.available("a")
    assert health.begin_request("a")  # the probe
    assert not health.available("a") and not health.begin_request("a")
    health.record_success("a", ttft_s=0.05)
    assert health.state("a") == "closed"
    assert health.begin_request("a") and health.begin_request("a")
    fail(health, "a", 1)
    assert health.state("a") == "closed"  # the failure count started over when it closed


def test_failed_probe_reopens_for_longer():
    health, clock = tracker(consecutive_failures=3, base_ejection_s=2.0)
    fail(health, "a", 3)
    clock.advance(2.0)
    assert health.begin_request("a")
    health.record_failure("a", "stream_broken")  # one failure is enough for a probe
    assert health.state("a") == "open"
    assert health.snapshot()["a"]["ejected_for_s"] == 4.0


def test_a_probe_that_never_reports_frees_its_slot():
    health, clock = tracker(consecutive_failures=1, base_ejection_s=1.0, probe_timeout_s=30.0)
    fail(health, "a", 1)
    clock.advance(1.0)
    assert health.begin_request("a")
    health.release("a")  # e.g. the client cancelled before the first token
    assert health.begin_request("a")
    clock.advance(29.0)
    assert not health.available("a")
    clock.advance(1.0)
    assert health.available("a") and health.state("a") == "half_open"


def test_slow_ttft_against_the_pool_median_counts_as_failure():
    health, _ = tracker(consecutive_failures=2, slow_ttft_factor=5.0, slow_ttft_min_s=1.0, min_ttft_samples=10)
    for name in ("b", "c", "d"):
        for _ in range(5):
            health.record_success(name, ttft_s=0.3)  # pool median 0.3 s
    health.record_success("a", ttft_s=1.4)  # under 5 × 0.3 = 1.5: fine
    health.record_success("a", ttft_s=1.6)
    assert health.snapshot()["a"]["consecutive_failures"] == 1
    assert health.snapshot()["a"]["last_failure"].startswith("slow")
    health.record_success("a", ttft_s=3.0)
    assert health.state("a") == "open"


def test_slow_ttft_needs_the_absolute_floor_and_enough_samples():
    health, _ = tracker(consecutive_failures=1, slow_ttft_factor=5.0, slow_ttft_min_s=1.0, min_ttft_samples=10)
    health.record_success("a", ttft_s=50.0)  # nothing to compare with yet
    assert health.state("a") == "closed"
    for _ in range(20):
        health.record_success("b", ttft_s=0.01)
    health.record_success("a", ttft_s=0.9)  # 90 × the median, but under the 1 s floor
    assert health.state("a") == "closed"
    health.record_success("a", ttft_s=1.1)
    assert health.state("a") == "open"


def test_a_slow_replica_cannot_hide_behind_its_own_samples():
    # half the pool's traffic is the slow replica's: the baseline is the other replicas' median
    health, _ = tracker(names=("a", "b"), consecutive_failures=3, max_ejected_fraction=0.5)
    for _ in range(20):
        health.record_success("b", ttft_s=0.2)
        health.record_success("a", ttft_s=4.0)
    assert health.state("a") == "open"
    assert health.state("b") == "closed"


def test_max_ejected_fraction_keeps_part_of_the_pool_serving():
    health, _ = tracker(names=("a", "b", "c", "d"), consecutive_failures=1, max_ejected_fraction=0.5)
    for name in "abcd":
        fail(health, name, 1)
    states = {name: health.state(name) for name in "abcd"}
    assert states == {"a": "open", "b": "open", "c": "closed", "d": "closed"}
    assert health.available("c") and health.available("d")


def test_the_ejection_cap_is_per_pool_and_a_lone_replica_is_never_ejected():
    clock = FakeClock()
    health = HealthTracker(HealthSettings(consecutive_failures=1, max_ejected_fraction=0.5), clock=clock)
    health.add("solo", None, pool="small-model")
    health.add("x", None, pool="big-model")
    health.add("y", None, pool="big-model")
    fail(health, "solo", 5)
    fail(health, "x", 1)
    assert health.state("solo") == "closed"
    assert health.state("x") == "open"
    health.remove("x")
    assert not health.available("x")
    health.record_failure("x", "5xx")  # a straggler after removal is ignored
    with pytest.raises(KeyError):
        health.state("x")


def test_unknown_reason_is_rejected():
    health, _ = tracker()
    with pytest.raises(ValueError):
        health.record_failure("a", "bad vibes")


def test_state_changes_are_logged_with_the_reason(caplog):
    health, clock = tracker(consecutive_failures=1, base_ejection_s=1.0)
    with caplog.at_level(logging.INFO, logger="tokenfleet.router.health"):
        health.record_failure("a", "connect", "ConnectError")
        clock.advance(1.0)
        health.begin_request("a")
        health.record_success("a")
    messages = [r.getMessage() for r in caplog.records]
    assert any("closed -> open" in m and "connect: ConnectError" in m for m in messages)
    assert any("open -> half_open" in m for m in messages)
    assert any("half_open -> closed" in m for m in messages)


# --- a real HTTP replica stand-in -------------------------------------------------------------------------------


class FakeReplica:
    """A real HTTP server in a background thread whose /health, /load and /metrics answer as `modes[path]` says:
    "ok", "500" or "hang" (no answer until the mode changes or `hang_s` passes)."""

    def __init__(self, load: dict | None = None, metrics_text: str = "", hang_s: float = 5.0) -> None:
        self.modes = {"/health": "ok", "/load": "ok", "/metrics": "ok"}
        self.load, self.metrics_text, self.hang_s = load or {}, metrics_text, hang_s
        self.hits = {path: 0 for path in self.modes}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(routes=[Route(path, self._handle) for path in self.modes])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> FakeReplica:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "fake replica did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.modes = dict.fromkeys(self.modes, "ok")  # lets hanging handlers finish
        self.server.should_exit = True
        self.thread.join(timeout=10)

    async def _handle(self, request: Request) -> Response:
        path = request.url.path
        self.hits[path] += 1
        deadline = time.monotonic() + self.hang_s
        while self.modes[path] == "hang" and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.modes[path] == "500":
            return JSONResponse({"error": {"message": "engine dead"}}, status_code=500)
        if path == "/load":
            return JSONResponse(self.load)
        if path == "/metrics":
            return PlainTextResponse(self.metrics_text, media_type="text/plain; version=0.0.4")
        return JSONResponse({"status": "ok"})


async def wait_for_state(health: HealthTracker, name: str, state: str, timeout_s: float) -> float:
    started = time.monotonic()
    while health.state(name) != state:
        assert time.monotonic() - started < timeout_s, f"{name} never became {state}: {health.snapshot()[name]}"
        await asyncio.sleep(0.01)
    return time.monotonic() - started


def test_active_checks_eject_a_failing_replica_and_readmit_it_on_the_first_passing_check(caplog):
    """An ejected replica is still checked: as soon as /health passes it is back, not when its (here 30 s)
    ejection time is over. A replica that came up late was kept out for its whole, growing ejection time."""
    settings = HealthSettings(check_interval_s=0.05, check_timeout_s=0.5, consecutive_failures=2, base_ejection_s=30.0)
    health = HealthTracker(settings)

    async def scenario(replica: FakeReplica) -> None:
        health.add("r1", replica.url)
        health.add("r2", None)  # no URL: passive signals only, and it keeps the pool at two
        async with httpx.AsyncClient() as client:
            checks = asyncio.create_task(health.run_active_checks(client))
            try:
                await asyncio.sleep(0.2)
                assert health.state("r1") == "closed"
                replica.modes["/health"] = "500"
                await wait_for_state(health, "r1", "open", 2.0)
                assert health.snapshot()["r1"]["last_failure"] == "5xx: GET /health answered 500"
                hits = replica.hits["/health"]
                await asyncio.sleep(0.3)
                assert replica.hits["/health"] > hits, "an ejected replica is still checked"
                assert health.state("r1") == "open", "failing checks keep it out"
                replica.modes["/health"] = "ok"
                assert await wait_for_state(health, "r1", "closed", 2.0) < 2.0
            finally:
                checks.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await checks

    with caplog.at_level(logging.INFO, logger="tokenfleet.router.health"), FakeReplica() as replica:
        asyncio.run(scenario(replica))
    changes = [m for m in (r.getMessage() for r in caplog.records) if "r1:" in m]
    assert [m.split("(")[0].split(": ")[1].strip() for m in changes] == ["closed -> open", "open -> closed"]
    assert "active health check passed" in changes[-1]


def test_a_replica_ejected_as_slow_waits_for_its_probe_despite_passing_checks():
    """/health answers fast on a replica whose first tokens are slow: only a probe after the ejection time
    (here the active check, once half-open) lets it back."""
    health, clock = tracker(names=(), consecutive_failures=1, base_ejection_s=10.0)

    async def check_once() -> None:
        async with httpx.AsyncClient() as client:
            await health.check_all(client)

    with FakeReplica() as replica:
        health.add("slow", replica.url)
        health.add("other", None)
        health.record_failure("slow", "slow", "ttft 9.000s")
        assert health.state("slow") == "open"
        asyncio.run(check_once())
        assert replica.hits["/health"] == 1 and health.state("slow") == "open"
        clock.advance(10.0)
        asyncio.run(check_once())
        assert health.state("slow") == "closed"


def test_a_hanging_health_endpoint_fails_within_the_timeout():
    settings = HealthSettings(check_timeout_s=0.3, consecutive_failures=1, base_ejection_s=10.0)
    health = HealthTracker(settings)

    async def scenario(replica: FakeReplica) -> float:
        health.add("stuck", replica.url)
        health.add("other", None)
        async with httpx.AsyncClient() as client:
            started = time.monotonic()
            await health.check_all(client)
            return time.monotonic() - started

    with FakeReplica() as replica:
        replica.modes["/health"] = "hang"
        elapsed = asyncio.run(scenario(replica))
    assert elapsed < 1.0
    assert health.state("stuck") == "open"
    assert health.snapshot()["stuck"]["last_failure"].startswith("timeout")


def test_a_refused_connection_is_a_connect_failure():
    health = HealthTracker(HealthSettings(consecutive_failures=1))
    health.add("gone", f"http://127.0.0.1:{free_port()}")
    health.add("other", None)

    async def scenario() -> None:
        async with httpx.AsyncClient() as client:
            await health.check_all(client)

    asyncio.run(scenario())
    assert health.state("gone") == "open"
    assert health.snapshot()["gone"]["last_failure"].startswith("connect")
