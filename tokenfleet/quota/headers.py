"""OpenAI's rate-limit headers: x-ratelimit-{limit,remaining,reset}-{requests,tokens} for the tightest scope, and
retry-after / retry-after-ms on a refusal."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BucketView:
    """One per-minute bucket as a client should see it."""

    limit: int  # the configured per-minute limit
    level: float  # what is left; below zero is debt
    capacity: float  # what the bucket holds when full (a hot tenant's slice holds a share of the limit)
    rate: float  # refill per second

    @property
    def remaining(self) -> int:
        return max(0, math.floor(self.level + 1e-9))

    @property
    def reset_s(self) -> float:
        """Seconds until the bucket is full again (OpenAI: until the limit "resets to its initial state")."""
        if self.rate <= 0:
            return 0.0
        return max(0.0, (self.capacity - self.level) / self.rate)


def format_duration(seconds: float) -> str:
    """As OpenAI (Go's time.Duration) writes it: "120ms", "1s", "1.5s", "6m0s", "1h2m3s". Rounded up to 1 ms."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    if minutes:
        return f"{minutes}m{secs}"
    return secs


def tightest(views: list[BucketView]) -> BucketView | None:
    """The bucket with the least left (ties: the one that takes longest to refill)."""
    return min(views, key=lambda v: (v.remaining, -v.reset_s), default=None)


def ratelimit_headers(
    requests: list[BucketView], tokens: list[BucketView], retry_after_s: float | None = None
) -> dict[str, str]:
    headers: dict[str, str] = {}
    for kind, views in (("requests", requests), ("tokens", tokens)):
        view = tightest(views)
        if view is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(view.limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(view.remaining)
            headers[f"x-ratelimit-reset-{kind}"] = format_duration(view.reset_s)
    if retry_after_s is not None:
        headers["retry-after"] = str(max(1, math.ceil(retry_after_s - 1e-9)))
        headers["retry-after-ms"] = str(max(1, math.ceil(retry_after_s * 1000 - 1e-6)))
    return headers
