"""What fits: the admission rule of every backend, and the Decision (reason, retry-after, headers) built from what a
backend saw. The Redis script applies the same rule inside Redis; this module explains its answer afterwards from
the levels the script returns, so both backends refuse with the same reasons and headers."""

from __future__ import annotations

import datetime as dt
import functools
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from tokenfleet.quota.base import Decision, Reservation, Scope
from tokenfleet.quota.headers import BucketView, ratelimit_headers
from tokenfleet.quota.limits import Limits

log = logging.getLogger("tokenfleet.quota")
DAY_S = 86400
EPOCH = dt.date(1970, 1, 1)
_Level = TypeVar("_Level", int, float)


@dataclass(frozen=True)
class ScopeState:
    """One scope as a backend saw it at decision time, before anything was charged."""

    scope: Scope
    limits: Limits  # as enforced here: a hot tenant's slice holds part of the concurrency and daily budget
    requests: float | None = None  # RPM bucket level (None: unlimited)
    tokens: float | None = None  # TPM bucket level; below zero is debt
    live: int | None = None  # concurrency leases held
    used_today: int | None = None
    share: float = 1.0  # a hot tenant's slice: its share of the per-minute buckets' capacity and refill rate
    max_share: float = 1.0  # the largest share a slice can ever get (request_too_large is judged against it)

    def view(self, limit: int, level: float) -> BucketView:
        return BucketView(limit, level, limit * self.share, limit / 60.0 * self.share)


def _reported(level: _Level | None, dimension: str, state: ScopeState) -> _Level:
    """The level of a limited dimension: every backend reports one for each limit it enforces (None only for an
    unlimited dimension)."""
    if level is None:
        raise ValueError(f"quota scope {state.scope.name!r}: {dimension} is limited but the backend reported no level")
    return level


@dataclass(frozen=True)
class Refusal:
    reason: str
    scope: str
    retry_after_s: float | None  # None: can never fit


@functools.lru_cache(maxsize=4)
def day_name(day: int) -> str:
    """The UTC day number `day` (days since 1970-01-01) as a reservation names it: "2026-11-30"."""
    return (EPOCH + dt.timedelta(days=day)).isoformat()


@functools.lru_cache(maxsize=4)
def day_number(name: str) -> int:
    """The inverse of day_name (raises ValueError for a name that is not a date)."""
    return (dt.date.fromisoformat(name) - EPOCH).days


def seconds_to_midnight(now: float) -> float:
    return DAY_S - now % DAY_S


def refusals(state: ScopeState, tokens: int, now: float, concurrency_retry_s: float) -> list[Refusal]:
    """Every dimension of this scope that refuses the request; empty when it fits."""
    lim, name, out = state.limits, state.scope.name, []
    rpm, tpm = lim.requests_per_minute, lim.tokens_per_minute
    if rpm is not None:
        request_level = _reported(state.requests, "requests_per_minute", state)
        if rpm == 0 or rpm * state.max_share < 1:
            out.append(Refusal("requests_per_minute", name, None))
        elif request_level < 1:
            out.append(Refusal("requests_per_minute", name, (1 - request_level) / (rpm / 60.0 * state.share)))
    if tpm is not None:
        token_level = _reported(state.tokens, "tokens_per_minute", state)
        if tpm == 0:
            out.append(Refusal("tokens_per_minute", name, None))
        elif tokens > tpm * state.max_share:
            out.append(Refusal("request_too_large", name, None))
        elif token_level < tokens:
            out.append(Refusal("tokens_per_minute", name, (tokens - token_level) / (tpm / 60.0 * state.share)))
    out.extend(_counted_refusals(state, tokens, now, concurrency_retry_s))
    return out


def _counted_refusals(state: ScopeState, tokens: int, now: float, concurrency_retry_s: float) -> list[Refusal]:
    lim, name, out = state.limits, state.scope.name, []
    conc, tpd = lim.concurrent_requests, lim.tokens_per_day
    if conc is not None:
        live = _reported(state.live, "concurrent_requests", state)
        if conc == 0:
            out.append(Refusal("concurrent_requests", name, None))
        elif live >= conc:
            # when a slot frees is unknowable; a short wait is the honest hint
            out.append(Refusal("concurrent_requests", name, concurrency_retry_s))
    if tpd is not None:
        used_today = _reported(state.used_today, "tokens_per_day", state)
        if tpd == 0:
            out.append(Refusal("tokens_per_day", name, None))
        elif tokens > tpd:
            out.append(Refusal("request_too_large", name, None))
        elif used_today + tokens > tpd:
            out.append(Refusal("tokens_per_day", name, seconds_to_midnight(now)))
    return out


def fits(state: ScopeState, tokens: int) -> bool:
    return not refusals(state, tokens, 0.0, 0.0)


def room(state: ScopeState, charged_today: bool) -> float:
    """How many more tokens a running request may take from this scope: its tokens-per-minute bucket, and its daily
    budget when the request was charged today (a request keeps the day it was admitted on); inf: unlimited."""
    lim, rooms = state.limits, [math.inf]
    if lim.tokens_per_minute is not None:
        rooms.append(math.floor(_reported(state.tokens, "tokens_per_minute", state)))
    if lim.tokens_per_day is not None and charged_today:
        rooms.append(lim.tokens_per_day - _reported(state.used_today, "tokens_per_day", state))
    return min(rooms)


def pick(found: list[Refusal]) -> Refusal:
    """The refusal to report: one that can never fit first, else the longest wait (nothing fits before it)."""
    never = [r for r in found if r.retry_after_s is None]
    if never:
        return never[0]
    waits = [(r.retry_after_s, r) for r in found if r.retry_after_s is not None]
    return max(waits, key=lambda wait: wait[0])[1]


def decide(
    states: list[ScopeState], tokens: int, reservation: Reservation | None, now: float, concurrency_retry_s: float
) -> Decision:
    """The Decision for a request the backend admitted (reservation given, `states` before charging) or refused."""
    if reservation is not None:
        return Decision(True, reservation, headers=BucketHeaders(states, tokens, 1))
    headers = dict(BucketHeaders(states, 0, 0))
    found = [r for s in states for r in refusals(s, tokens, now, concurrency_retry_s)]
    if not found:  # cannot happen while this module and the Lua script agree
        log.error("quota backend refused a request that fits every scope; answering retry in 1 s")
        found = [Refusal("requests_per_minute", states[0].scope.name, 1.0)]
    refusal = pick(found)
    headers.update(ratelimit_headers([], [], refusal.retry_after_s))
    return Decision(False, None, refusal.reason, refusal.scope, refusal.retry_after_s, headers)


class BucketHeaders(Mapping[str, str]):
    """The x-ratelimit-* headers of the per-minute buckets after charging `tokens` and `requests`, built when first
    read: the states are what the backend saw at decision time (frozen), so the headers are the same whenever they
    are read, and a caller that never reads them (the fleet simulator) never pays for them."""

    def __init__(self, states: list[ScopeState], tokens: int, requests: int) -> None:
        self._states, self._tokens, self._requests = states, tokens, requests
        self._headers: dict[str, str] | None = None

    def _built(self) -> dict[str, str]:
        if self._headers is None:
            states, tokens, requests = self._states, self._tokens, self._requests
            request_views = [
                s.view(s.limits.requests_per_minute, _reported(s.requests, "requests_per_minute", s) - requests)
                for s in states
                if s.limits.requests_per_minute is not None
            ]
            token_views = [
                s.view(s.limits.tokens_per_minute, _reported(s.tokens, "tokens_per_minute", s) - tokens)
                for s in states
                if s.limits.tokens_per_minute is not None
            ]
            self._headers = ratelimit_headers(request_views, token_views)
        return self._headers

    def __getitem__(self, name: str) -> str:
        return self._built()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._built())

    def __repr__(self) -> str:
        return repr(self._built())
