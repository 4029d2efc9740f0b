"""The usage event: one record per request that finished, was cancelled or failed — what billing, dashboards and
capacity planning are built from. Validated on construction, so nothing malformed reaches the outbox or the log."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

STATUSES = ("finished", "cancelled", "failed")

# Longest value per text field; the SQL columns have these lengths (store/models.py), so a valid event always fits.
MAX_LENGTHS = {
    "request_id": 128,
    "org_id": 64,
    "user_id": 64,
    "key_id": 64,
    "model": 200,
    "replica": 200,
    "pool": 64,
    "tier": 64,
    "status": 16,
    "route": 500,
}
# replica, pool and route may be "": a request can fail before a replica is chosen.
REQUIRED = ("request_id", "org_id", "user_id", "key_id", "model", "tier")
COUNTS = ("input_tokens", "cached_tokens", "output_tokens")


@dataclass(frozen=True)
class UsageEvent:
    request_id: str  # unique per request: the idempotency key from the outbox to the warehouse
    org_id: str
    user_id: str
    key_id: str
    model: str  # the pinned version that served it, not the alias asked for
    replica: str
    pool: str
    tier: str
    input_tokens: int
    cached_tokens: int  # the part of input_tokens served from the prefix cache
    output_tokens: int
    ttft_s: float | None  # None when no token was produced
    latency_s: float
    status: str  # "finished" | "cancelled" | "failed"
    route: str  # the router's decision, logged for offline evaluation
    started_at: datetime
    ended_at: datetime
    engine_s: float = 0.0  # its share of the replica's busy time: what replica-hour cost is divided by

    def __post_init__(self) -> None:
        _check_text(self)
        _check_numbers(self)
        for name in ("started_at", "ended_at"):  # stored as UTC whatever zone they came in
            object.__setattr__(self, name, _utc(getattr(self, name), name))
        if self.ended_at < self.started_at:
            raise ValueError(f"ended_at {self.ended_at.isoformat()} is before started_at {self.started_at.isoformat()}")

    @property
    def day(self) -> date:
        """The UTC day the request is billed on: the day it ended."""
        return self.ended_at.date()

    def to_dict(self) -> dict[str, Any]:
        # every field is a scalar or a datetime: a shallow copy (dataclasses.asdict deep-copies each datetime, a
        # visible share of the gateway's CPU per request)
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["started_at"] = self.started_at.isoformat()
        values["ended_at"] = self.ended_at.isoformat()
        return values

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_dict(cls, values: object) -> UsageEvent:
        if not isinstance(values, dict):
            raise ValueError(f"a usage event must be a JSON object, got {type(values).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing, unknown = required - values.keys(), values.keys() - names
        if missing or unknown:
            raise ValueError(f"usage event fields: missing {sorted(missing)}, unknown {sorted(unknown)}")
        given = dict(values)
        for name in ("started_at", "ended_at"):
            given[name] = _parse_time(given[name], name)
        return cls(**given)

    @classmethod
    def from_json(cls, text: str | bytes) -> UsageEvent:
        try:
            values = json.loads(text)
        except (TypeError, ValueError) as e:
            raise ValueError(f"a usage event must be JSON: {e}") from None
        return cls.from_dict(values)


def _check_text(event: UsageEvent) -> None:
    for name, limit in MAX_LENGTHS.items():
        value = getattr(event, name)
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r}")
        if name in REQUIRED and not value:
            raise ValueError(f"{name} must not be empty")
        if len(value) > limit:
            raise ValueError(f"{name} is longer than {limit} characters")
    if event.status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {event.status!r}")


def _check_numbers(event: UsageEvent) -> None:
    for name in COUNTS:
        value = getattr(event, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if event.cached_tokens > event.input_tokens:
        raise ValueError(f"cached_tokens ({event.cached_tokens}) exceeds input_tokens ({event.input_tokens})")
    _check_seconds(event.latency_s, "latency_s")
    _check_seconds(event.engine_s, "engine_s")
    if event.ttft_s is not None:
        _check_seconds(event.ttft_s, "ttft_s")


def _check_seconds(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")


def _utc(value: object, name: str) -> datetime:
    if not isinstance(value, datetime):
        raise ValueError(f"{name} must be a datetime, got {value!r}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be timezone-aware (UTC), got a naive datetime")
    return value.astimezone(UTC)


def _parse_time(value: object, name: str) -> datetime:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be an ISO 8601 string, got {value!r}")
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{name} is not an ISO 8601 time: {value!r}") from None
