"""Per-replica health for the router: a circuit breaker per replica fed by passive signals (request errors, slow
first tokens against the pool's median) and by active GET /health checks.

States: "closed" (healthy, takes traffic), "open" (ejected until a time), "half_open" (the ejection time has
passed; exactly one request or active check goes through as a probe: success closes, failure re-opens for longer).
Active checks go on while a replica is ejected: one that passes readmits it at once (as Envoy un-ejects a host on a
passing active check), unless it was ejected as slow, which /health cannot disprove.

Usage by a router: filter candidates with `available(name)` (no side effects), then call `begin_request(name)`
on the one it picks (claims the probe slot of a half-open replica), and report the outcome with
`record_success` / `record_failure`, or `release(name)` when the request ended without a verdict (the client
cancelled before the first token).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
REASONS = frozenset({"connect", "timeout", "5xx", "stream_broken", "slow", "health_check"})


@dataclass
class HealthSettings:
    check_interval_s: float = 2.0  # active GET /health
    check_timeout_s: float = 1.0
    consecutive_failures: int = 3  # passive: this many errors in a row eject (connection errors, 5xx, timeouts)
    slow_ttft_factor: float = 5.0  # passive: a TTFT this many times the pool's median counts as a failure ...
    slow_ttft_min_s: float = 1.0  # ... and only above this absolute floor
    ttft_window: int = 256  # recent TTFT samples per pool that the median is taken over
    min_ttft_samples: int = 10  # no slow verdicts until the rest of the pool has this many samples
    base_ejection_s: float = 5.0  # ejection time = base × number of times ejected ...
    max_ejection_multiplier: int = 10  # ... capped at this many times the base
    ejection_decay_s: float = 60.0  # each this long spent closed forgives one past ejection
    max_ejected_fraction: float = 0.5  # never eject more than this share of a pool (keep serving with the rest)
    probe_timeout_s: float = 60.0  # a probe that never reports frees its slot after this long


@dataclass
class ReplicaHealth:
    name: str
    base_url: str | None
    pool: str
    state: str = CLOSED
    consecutive_failures: int = 0
    ejections: int = 0
    ejected_until: float = 0.0
    probe_started: float | None = None  # when the half-open probe slot was taken; None while free
    ejected_for: str | None = None  # the failure reason of the current (or last) ejection
    last_failure: str | None = None
    changed_at: float = 0.0

    def is_ejected(self) -> bool:
        return self.state != CLOSED


@dataclass
class _Pool:
    members: set[str] = field(default_factory=set)
    ttfts: deque[tuple[str, float]] = field(default_factory=deque)  # (replica name, ttft seconds), newest last


class HealthTracker:
    def __init__(self, settings: HealthSettings | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings or HealthSettings()
        self.clock = clock
        self.replicas: dict[str, ReplicaHealth] = {}
        self.pools: dict[str, _Pool] = {}

    # --- membership -------------------------------------------------------------------------------------------

    def add(self, name: str, base_url: str | None = None, pool: str = "default") -> None:
        """Adds a replica (healthy), or updates the URL / pool of a known one and keeps its state."""
        replica = self.replicas.get(name)
        if replica is None:
            self.replicas[name] = ReplicaHealth(name, base_url, pool, changed_at=self.clock())
        else:
            self.pools[replica.pool].members.discard(name)
            replica.base_url, replica.pool = base_url, pool
        self.pools.setdefault(pool, _Pool(ttfts=deque(maxlen=self.settings.ttft_window))).members.add(name)

    def remove(self, name: str) -> None:
        replica = self.replicas.pop(name, None)
        if replica is not None:
            self.pools[replica.pool].members.discard(name)

    # --- what the router asks ---------------------------------------------------------------------------------

    def available(self, name: str) -> bool:
        """Closed, or half-open with its probe slot free. Takes nothing: call begin_request on the one chosen."""
        replica = self._refreshed(name)
        if replica is None:
            return False
        return replica.state == CLOSED or (replica.state == HALF_OPEN and replica.probe_started is None)

    def begin_request(self, name: str) -> bool:
        """True if a request may go to `name` now; on a half-open replica this claims its single probe slot."""
        if not self.available(name):
            return False
        replica = self.replicas[name]
        if replica.state == HALF_OPEN:
            replica.probe_started = self.clock()
        return True

    def release(self, name: str) -> None:
        """Frees a claimed probe slot without a verdict (the request ended before telling anything)."""
        replica = self.replicas.get(name)
        if replica is not None:
            replica.probe_started = None

    def state(self, name: str) -> str:
        replica = self._refreshed(name)
        if replica is None:
            raise KeyError(name)
        return replica.state

    def snapshot(self) -> dict[str, dict[str, Any]]:
        now = self.clock()
        out = {}
        for name in list(self.replicas):
            r = self._refreshed(name)
            if r is None:  # removed while we iterate
                continue
            out[name] = {
                "state": r.state,
                "pool": r.pool,
                "base_url": r.base_url,
                "consecutive_failures": r.consecutive_failures,
                "ejections": r.ejections,
                "ejected_for_s": round(max(0.0, r.ejected_until - now), 3) if r.state == OPEN else 0.0,
                "probe_in_flight": r.probe_started is not None,
                "last_failure": r.last_failure,
                "since_s": round(now - r.changed_at, 3),
            }
        return out

    # --- what the router reports ------------------------------------------------------------------------------

    def record_success(self, name: str, ttft_s: float | None = None) -> None:
        """A request (or check) went well. With `ttft_s`, a first token far slower than the pool's counts as a
        failure ("slow") instead."""
        replica = self._refreshed(name)
        if replica is None:
            return
        if ttft_s is not None and self._is_slow(replica, ttft_s):
            self.record_failure(name, "slow", f"ttft {ttft_s:.3f}s")
            return
        replica.consecutive_failures = 0
        if replica.state == HALF_OPEN:
            self._close(replica)

    def record_failure(self, name: str, reason: str, detail: str = "") -> None:
        """reason: "connect" | "timeout" | "5xx" | "stream_broken" | "slow" | "health_check"."""
        if reason not in REASONS:
            raise ValueError(f"unknown failure reason {reason!r}; expected one of {sorted(REASONS)}")
        replica = self._refreshed(name)
        if replica is None or replica.state == OPEN:
            return  # removed meanwhile, or a straggler from before the ejection: it is out already
        why = f"{reason}: {detail}" if detail else reason
        replica.last_failure = why
        replica.consecutive_failures += 1
        if replica.state == HALF_OPEN:
            self._eject(replica, reason, f"probe failed ({why})")
        elif replica.consecutive_failures >= self.settings.consecutive_failures:
            self._try_eject(replica, reason, f"{replica.consecutive_failures} failures in a row, last {why}")

    def record_check_passed(self, name: str) -> None:
        """An active health check passed: an ejected replica is readmitted now rather than when its ejection time
        is over; one ejected as slow still waits for its probe (a /health answer says nothing about its speed)."""
        replica = self._refreshed(name)
        if replica is None:
            return
        if replica.state == OPEN and replica.ejected_for != "slow":
            self._close(replica, "active health check passed")
        else:
            self.record_success(name)

    # --- active checks ----------------------------------------------------------------------------------------

    async def run_active_checks(self, client: httpx.AsyncClient) -> None:
        """GET {base_url}/health on every replica with a URL, every check_interval_s, until cancelled."""
        while True:
            started = self.clock()
            try:
                await self.check_all(client)
            except Exception:  # a bug here must not silently stop health checks for the whole fleet
                log.exception("active health checks failed")
            await asyncio.sleep(max(0.0, self.settings.check_interval_s - (self.clock() - started)))

    async def check_all(self, client: httpx.AsyncClient) -> None:
        """One round of active checks, ejected replicas included (a pass readmits them); a half-open one is
        checked only if its probe slot is free (the check is then the probe)."""
        names = [name for name, r in self.replicas.items() if r.base_url and self._checkable(name)]
        await asyncio.gather(*(self._check(client, name) for name in names))

    def _checkable(self, name: str) -> bool:
        return self.available(name) or self.replicas[name].state == OPEN

    async def _check(self, client: httpx.AsyncClient, name: str) -> None:
        replica = self._refreshed(name)  # it may have been removed since the round began
        if replica is None or not replica.base_url:
            return
        if replica.state != OPEN and not self.begin_request(name):  # a half-open replica's check is its probe
            return
        url = replica.base_url.rstrip("/") + "/health"
        reason, detail = await _probe(client, url, self.settings.check_timeout_s)
        if name not in self.replicas:
            return
        if reason is None:
            self.record_check_passed(name)
        else:
            self.record_failure(name, reason, f"GET /health {detail}")

    # --- internals --------------------------------------------------------------------------------------------

    def _refreshed(self, name: str) -> ReplicaHealth | None:
        """The replica with time-driven transitions applied: open → half_open once its time is up, and a probe
        that never reported gives its slot back."""
        replica = self.replicas.get(name)
        if replica is None:
            return None
        now = self.clock()
        if replica.state == OPEN and now >= replica.ejected_until:
            self._set_state(replica, HALF_OPEN, "ejection time over, letting one probe through")
        if replica.probe_started is not None and now - replica.probe_started >= self.settings.probe_timeout_s:
            replica.probe_started = None
        return replica

    def _is_slow(self, replica: ReplicaHealth, ttft_s: float) -> bool:
        pool = self.pools[replica.pool]
        if ttft_s <= self.settings.slow_ttft_min_s:  # under the floor nothing is slow: skip the median
            pool.ttfts.append((replica.name, ttft_s))
            return False
        # the pool's median without this replica's own samples, so a slow replica cannot drag the baseline to itself
        others = [t for n, t in pool.ttfts if n != replica.name]
        pool.ttfts.append((replica.name, ttft_s))
        if len(others) < self.settings.min_ttft_samples:
            return False
        return ttft_s > self.settings.slow_ttft_factor * statistics.median(others)

    def _try_eject(self, replica: ReplicaHealth, reason: str, why: str) -> None:
        pool = self.pools[replica.pool]
        ejected = sum(1 for n in pool.members if self.replicas[n].is_ejected())
        if ejected + 1 > self.settings.max_ejected_fraction * len(pool.members) + 1e-9:
            log.warning(
                "replica %s would be ejected (%s) but %d of %d in pool %s are out already; keeping it",
                replica.name,
                why,
                ejected,
                len(pool.members),
                replica.pool,
            )
            return
        self._eject(replica, reason, why)

    def _eject(self, replica: ReplicaHealth, reason: str, why: str) -> None:
        now = self.clock()
        if replica.state == CLOSED and self.settings.ejection_decay_s > 0:
            forgiven = int((now - replica.changed_at) / self.settings.ejection_decay_s)
            replica.ejections = max(0, replica.ejections - forgiven)
        replica.ejections += 1
        duration = self.settings.base_ejection_s * min(replica.ejections, self.settings.max_ejection_multiplier)
        replica.ejected_until, replica.ejected_for = now + duration, reason
        replica.probe_started = None
        self._set_state(replica, OPEN, f"{why}; ejected for {duration:g}s (ejection #{replica.ejections})")

    def _close(self, replica: ReplicaHealth, why: str = "probe succeeded") -> None:
        replica.probe_started = None
        replica.consecutive_failures = 0
        self._set_state(replica, CLOSED, why)

    def _set_state(self, replica: ReplicaHealth, state: str, why: str) -> None:
        log.info("replica %s: %s -> %s (%s)", replica.name, replica.state, state, why)
        replica.state, replica.changed_at = state, self.clock()


async def _probe(client: httpx.AsyncClient, url: str, timeout_s: float) -> tuple[str | None, str]:
    """(None, "") if GET url answered 2xx within timeout_s, else (failure reason, detail)."""
    try:
        # wait_for bounds the whole exchange: httpx's timeout applies per read, so a trickling server could outlast it
        response = await asyncio.wait_for(client.get(url, timeout=timeout_s), timeout_s)
    except (TimeoutError, httpx.TimeoutException):
        return "timeout", f"no answer within {timeout_s:g}s"
    except httpx.HTTPError as e:
        return "connect", e.__class__.__name__
    if response.is_success:
        return None, ""
    return ("5xx" if response.status_code >= 500 else "health_check"), f"answered {response.status_code}"
