"""Forecasts of a pool's arrival rate (requests/s) at a future time, so the autoscaler can start replicas a cold
start ahead of the daily curve. Two kinds: a curve given in the fleet file, and a daily profile learned from the
arrival rates the autoscaler observes. Both are periodic (a day by default) and deterministic."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

DAY_S = 86400.0


class Forecast(Protocol):
    def rate(self, t: float) -> float | None:
        """Expected arrivals per second at time `t` (the autoscaler's clock), or None when it cannot tell yet."""

    def observe(self, t: float, rate: float) -> None:
        """The arrival rate measured at `t` (a learning forecast folds it into its profile)."""


def _periodic_interpolate(xs: Sequence[float], ys: Sequence[float], x: float, period: float) -> float:
    """Piecewise-linear through (xs, ys), sorted, wrapping around at `period`."""
    x %= period
    i = bisect.bisect_right(xs, x)
    x0, y0 = (xs[i - 1], ys[i - 1]) if i > 0 else (xs[-1] - period, ys[-1])
    x1, y1 = (xs[i], ys[i]) if i < len(xs) else (xs[0] + period, ys[0])
    if x1 == x0:
        return y0
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class CurveForecast:
    """A given daily curve: `points` are (hour of the day, requests/s), interpolated linearly and wrapping at
    midnight. With `period_s` other than a day, the 24 hours are compressed into `period_s` (simulations, tests).
    Time 0 is midnight, so with the wall clock (time.time()) the hours are UTC."""

    points: Sequence[tuple[float, float]]
    period_s: float = DAY_S

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a forecast curve needs at least one (hour, requests/s) point")
        if not self.period_s > 0:
            raise ValueError(f"period_s must be positive, got {self.period_s!r}")
        for point in self.points:
            if len(point) != 2 or not 0 <= point[0] < 24 or not point[1] >= 0:
                raise ValueError(f"a curve point is [hour in 0..24, requests/s >= 0], got {list(point)!r}")
        ordered = sorted((float(h), float(r)) for h, r in self.points)
        self._xs = [h / 24 * self.period_s for h, _ in ordered]
        self._ys = [r for _, r in ordered]

    def rate(self, t: float) -> float:
        return _periodic_interpolate(self._xs, self._ys, t, self.period_s)

    def observe(self, t: float, rate: float) -> None:
        pass


@dataclass
class SeasonalForecast:
    """A daily profile learned from observed arrival rates: the period is cut into buckets; each bucket's mean over
    a day is blended into the profile (an exponential average across days, weight `alpha` for the newest day).
    Between bucket centres the profile is interpolated; it says nothing (None) until it has seen a bucket."""

    period_s: float = DAY_S
    bucket_s: float = 900.0
    alpha: float = 0.5
    profile: dict[int, float] = field(default_factory=dict)  # bucket -> requests/s
    _current: tuple[int, int] | None = None  # (period number, bucket) being accumulated
    _sum: float = 0.0
    _count: int = 0

    def __post_init__(self) -> None:
        if not self.period_s > 0 or not 0 < self.bucket_s <= self.period_s:
            raise ValueError("need period_s > 0 and 0 < bucket_s <= period_s")
        if abs(self.period_s / self.bucket_s - round(self.period_s / self.bucket_s)) > 1e-9:
            raise ValueError(f"bucket_s must divide period_s evenly, got {self.bucket_s!r} and {self.period_s!r}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha!r}")

    def observe(self, t: float, rate: float) -> None:
        if not rate >= 0 or math.isinf(rate):
            return
        key = (math.floor(t / self.period_s), int((t % self.period_s) // self.bucket_s))
        if self._current is not None and key != self._current:
            self._fold()
        self._current = key
        self._sum += rate
        self._count += 1

    def _fold(self) -> None:
        """The bucket being accumulated is over: blend its mean into the profile."""
        bucket, mean = self._current[1], self._sum / self._count
        old = self.profile.get(bucket)
        self.profile[bucket] = mean if old is None else (1 - self.alpha) * old + self.alpha * mean
        self._sum, self._count = 0.0, 0

    def rate(self, t: float) -> float | None:
        if not self.profile:
            return None
        seen = sorted(self.profile)
        xs = [(b + 0.5) * self.bucket_s for b in seen]
        return _periodic_interpolate(xs, [self.profile[b] for b in seen], t, self.period_s)
