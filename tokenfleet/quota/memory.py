"""The quota in process memory, for the embedded single-process mode and as the failover's local limiter. Same
semantics as the Redis backend. A decision never awaits, so on one event loop it is atomic without locks."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tokenfleet.quota.base import Decision, Remaining, Reservation, Scope
from tokenfleet.quota.checked import CheckedQuota
from tokenfleet.quota.rules import DAY_S, ScopeState, day_name, day_number, decide, fits, room


@dataclass
class _Bucket:
    level: float
    at: float


@dataclass
class _ScopeData:
    buckets: dict[str, _Bucket] = field(default_factory=dict)  # "rpm" / "tpm"
    live: dict[str, float] = field(default_factory=dict)  # request id -> lease expiry
    next_expiry: float = math.inf  # no lease in `live` expires before this (a lower bound: released ones stay)
    day: int = -1  # the UTC day number `used` counts (a day's usage limits only that day)
    used: int = 0
    keep_until: float = 0.0  # after this, forgetting the scope changes nothing (buckets full, no leases, day over)


class MemoryQuota(CheckedQuota):
    name = "memory"

    def __init__(
        self,
        *,
        lease_s: float = 900.0,
        marker_ttl_s: float = 3600.0,
        concurrency_retry_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        sweep_interval_s: float = 60.0,
    ) -> None:
        if lease_s <= 0 or marker_ttl_s <= 0 or concurrency_retry_s <= 0:
            raise ValueError("lease_s, marker_ttl_s and concurrency_retry_s must be positive")
        self.lease_s, self.marker_ttl_s, self.concurrency_retry_s = lease_s, marker_ttl_s, concurrency_retry_s
        self.clock, self.sweep_interval_s = clock, sweep_interval_s
        self._scopes: dict[str, _ScopeData] = {}
        self._reconciled: dict[str, float] = {}  # request id -> marker expiry
        self._swept = 0.0

    async def _reserve(self, request_id: str, scopes: tuple[Scope, ...], tokens: int) -> Decision:
        now = self.clock()
        self._sweep(now)
        day = int(now // DAY_S)
        states = [self._state(scope, now, day) for scope in scopes]
        reservation = None
        if all(fits(state, tokens) for state in states):
            for state in states:
                self._charge(state, request_id, tokens, now, day)
            reservation = Reservation(request_id, scopes, tokens, day_name(day), self.name)
        return decide(states, tokens, reservation, now, self.concurrency_retry_s)

    async def _reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        now = self.clock()
        if self._reconciled.get(reservation.request_id, 0.0) > now:
            return
        self._reconciled[reservation.request_id] = now + self.marker_ttl_s
        extra = used_tokens - reservation.tokens
        day = day_number(reservation.day)
        for scope in reservation.scopes:
            data = self._data(scope)
            tpm = scope.limits.tokens_per_minute
            if tpm:
                self._store(data, "tpm", min(tpm, self._level(data, "tpm", tpm, now) - extra), tpm, now)
            data.live.pop(reservation.request_id, None)
            if scope.limits.tokens_per_day and data.day == day:
                data.used = max(0, data.used + extra)

    async def _extend(self, reservation: Reservation, at_least: int, at_most: int) -> Reservation | None:
        now = self.clock()
        if self._reconciled.get(reservation.request_id, 0.0) > now:
            return None
        day = int(now // DAY_S)
        charged_today = day_number(reservation.day) == day
        states = [self._state(scope, now, day) for scope in reservation.scopes]
        grant = min(at_most, *(room(state, charged_today) for state in states))
        if grant < at_least:
            return None
        for state in states:
            self._charge_more(state, int(grant), now, day, charged_today)
        return replace(reservation, tokens=reservation.tokens + int(grant))

    async def remaining(self, scope: Scope) -> Remaining:
        now = self.clock()
        state = self._state(scope, now, int(now // DAY_S))
        conc, tpd = scope.limits.concurrent_requests, scope.limits.tokens_per_day
        return Remaining(
            state.requests,
            state.tokens,
            None if conc is None or state.live is None else conc - state.live,
            None if tpd is None or state.used_today is None else tpd - state.used_today,
        )

    async def close(self) -> None:
        self._scopes.clear()
        self._reconciled.clear()

    def _data(self, scope: Scope) -> _ScopeData:
        data = self._scopes.get(scope.name)
        if data is None:
            data = self._scopes[scope.name] = _ScopeData()
        return data

    def _state(self, scope: Scope, now: float, day: int) -> ScopeState:
        """What the scope holds now, refilled; changes nothing but dropping expired leases."""
        lim, data = scope.limits, self._data(scope)
        rpm, tpm, conc, tpd = (
            lim.requests_per_minute,
            lim.tokens_per_minute,
            lim.concurrent_requests,
            lim.tokens_per_day,
        )
        live = None
        if conc is not None:
            if data.next_expiry <= now:
                self._drop_expired(data, now)
            live = len(data.live)
        return ScopeState(
            scope,
            lim,
            None if rpm is None else self._level(data, "rpm", rpm, now),
            None if tpm is None else self._level(data, "tpm", tpm, now),
            live,
            None if tpd is None else (data.used if data.day == day else 0),
        )

    def _charge(self, state: ScopeState, request_id: str, tokens: int, now: float, day: int) -> None:
        data, rpm, tpm = self._data(state.scope), state.limits.requests_per_minute, state.limits.tokens_per_minute
        if rpm is not None and state.requests is not None:
            self._store(data, "rpm", state.requests - 1, rpm, now)
        if tpm is not None and state.tokens is not None:
            self._store(data, "tpm", state.tokens - tokens, tpm, now)
        if state.live is not None:
            data.live[request_id] = expiry = now + self.lease_s
            data.next_expiry = min(data.next_expiry, expiry)
            data.keep_until = max(data.keep_until, now + self.lease_s)
        if state.used_today is not None:
            data.day, data.used = day, state.used_today + tokens
            data.keep_until = max(data.keep_until, (day + 1) * DAY_S)

    def _charge_more(self, state: ScopeState, tokens: int, now: float, day: int, charged_today: bool) -> None:
        data, tpm = self._data(state.scope), state.limits.tokens_per_minute
        if tpm is not None and state.tokens is not None:
            self._store(data, "tpm", state.tokens - tokens, tpm, now)
        if state.used_today is not None and charged_today:
            data.day, data.used = day, state.used_today + tokens
            data.keep_until = max(data.keep_until, (day + 1) * DAY_S)

    @staticmethod
    def _drop_expired(data: _ScopeData, now: float) -> None:
        for request_id in [r for r, expiry in data.live.items() if expiry <= now]:
            del data.live[request_id]
        data.next_expiry = min(data.live.values(), default=math.inf)

    @staticmethod
    def _level(data: _ScopeData, dim: str, limit: int, now: float) -> float:
        bucket = data.buckets.get(dim)
        if bucket is None:
            return float(limit)
        return min(float(limit), bucket.level + max(0.0, now - bucket.at) * limit / 60.0)

    @staticmethod
    def _store(data: _ScopeData, dim: str, level: float, limit: int, now: float) -> None:
        data.buckets[dim] = _Bucket(level, now)
        data.keep_until = max(data.keep_until, now + (limit - level) / (limit / 60.0))

    def _sweep(self, now: float) -> None:
        """Forgets idle scopes and old reconcile markers, so idle tenants cost nothing."""
        if now - self._swept < self.sweep_interval_s:
            return
        self._swept = now
        self._scopes = {name: d for name, d in self._scopes.items() if d.keep_until > now or d.live}
        self._reconciled = {r: expiry for r, expiry in self._reconciled.items() if expiry > now}
