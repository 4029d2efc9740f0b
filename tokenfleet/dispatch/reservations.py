"""Provisioned throughput: a tenant's guaranteed share of the pool's dispatched tokens.

Shares are measured over a sliding window, but never from before the tenant last became backlogged: a tenant
that was idle gets no credit for the capacity it did not ask for, so coming back it cannot take the whole pool
for a burst to "catch up"; its guarantee is a floor while it has work, not a bank."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass


@dataclass
class Usage:
    """One dispatch in the window; its tokens may be reconciled later."""

    seq: int
    at: float
    tenant: str
    tokens: int
    live: bool = True  # still inside the window


@dataclass
class _Period:
    """Tokens since a provisioned tenant last became backlogged."""

    since_seq: int
    since: float
    used: int = 0
    total: int = 0


def validate_shares(shares: Mapping[str, float]) -> dict[str, float]:
    for tenant, share in shares.items():
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"provisioned share of tenant {tenant!r} must be in (0, 1], got {share!r}")
    total = sum(shares.values())
    if total > 1 + 1e-9:
        raise ValueError(f"provisioned shares sum to {total:g}, more than the whole pool (1)")
    return dict(shares)


class Reservations:
    def __init__(
        self, shares: Mapping[str, float], window_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not window_s > 0:
            raise ValueError(f"provisioned_window_s must be positive, got {window_s!r}")
        self.shares = validate_shares(shares)
        self.window_s = window_s
        self._clock = clock
        self._seq = itertools.count()
        self._window: deque[Usage] = deque()
        self._window_used: dict[str, int] = {}
        self._window_total = 0
        self._periods: dict[str, _Period] = {}

    def __bool__(self) -> bool:
        return bool(self.shares)

    def became_backlogged(self, tenant: str) -> None:
        self._periods[tenant] = _Period(since_seq=next(self._seq), since=self._clock())

    def record(self, tenant: str, tokens: int) -> Usage:
        self._expire()
        usage = Usage(next(self._seq), self._clock(), tenant, tokens)
        self._window.append(usage)
        self._count(usage, tokens)
        return usage

    def reconcile(self, usage: Usage, tokens: int) -> None:
        """The dispatch turned out to be `tokens` long, not its estimate."""
        self._expire()
        if usage.live:
            self._count(usage, tokens - usage.tokens)
            usage.tokens = tokens

    def behind(self, tenants: Iterable[str]) -> list[str]:
        """Of these tenants (with queued work), those below their share, furthest below first."""
        ratios = []
        for tenant in tenants:
            share = self.shares.get(tenant)
            if share is None:
                continue
            used, total = self._measure(tenant)
            if used < share * total or total == 0:
                ratios.append((used / (share * total) if total else 0.0, tenant))
        return [tenant for _, tenant in sorted(ratios)]

    def _measure(self, tenant: str) -> tuple[int, int]:
        self._expire()
        period = self._periods.get(tenant)
        if period is not None and period.since > self._clock() - self.window_s:
            return period.used, period.total
        return self._window_used.get(tenant, 0), self._window_total

    def _count(self, usage: Usage, tokens: int) -> None:
        self._window_total += tokens
        self._window_used[usage.tenant] = self._window_used.get(usage.tenant, 0) + tokens
        for tenant, period in self._periods.items():
            if usage.seq > period.since_seq:
                period.total += tokens
                if tenant == usage.tenant:
                    period.used += tokens

    def _expire(self) -> None:
        horizon = self._clock() - self.window_s
        while self._window and self._window[0].at <= horizon:
            usage = self._window.popleft()
            usage.live = False
            self._window_total -= usage.tokens
            left = self._window_used.get(usage.tenant, 0) - usage.tokens
            if left:
                self._window_used[usage.tenant] = left
            else:
                self._window_used.pop(usage.tenant, None)
