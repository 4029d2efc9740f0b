"""The quota service's interface and records: scopes, reservations, decisions, and the errors a gateway sees."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tokenfleet.quota.limits import Limits

# The refused dimension a Decision names; request_too_large: it can never fit, whatever the wait.
REASONS = ("requests_per_minute", "tokens_per_minute", "concurrent_requests", "tokens_per_day", "request_too_large")
MAX_TOKENS = 2**53  # Lua numbers are doubles: whole numbers are exact up to here


@dataclass(frozen=True)
class Scope:
    name: str  # e.g. "org:acme" or "user:acme/7": one bucket set per scope
    tenant: str  # the organisation id: shard key and Redis Cluster hash tag, shared by all scopes of one request
    limits: Limits

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"scope name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.tenant, str) or not self.tenant or "{" in self.tenant or "}" in self.tenant:
            raise ValueError(f"tenant must be a non-empty string without braces, got {self.tenant!r}")
        if not isinstance(self.limits, Limits):
            raise ValueError(f"limits must be a Limits, got {type(self.limits).__name__}")


def scopes_for(org: str, user: str, org_limits: Limits, user_limits: Limits) -> tuple[Scope, Scope]:
    """A request's two quota scopes, its organisation's and its user's: the one place their names are made (the
    gateway for a caller, the simulator for a simulated tenant)."""
    return Scope(f"org:{org}", org, org_limits), Scope(f"user:{org}/{user}", org, user_limits)


@dataclass(frozen=True)
class Reservation:
    request_id: str
    scopes: tuple[Scope, ...]
    tokens: int  # what was reserved
    day: str  # UTC day (YYYY-MM-DD) the daily budget was charged on, so reconcile hits the same counter
    backend: str  # which backend holds it ("redis" / "memory"), so failover reconciles in the right place
    slice: int | None = None  # the slice of a hot tenant that was charged (Redis only); None: not sliced
    leased: bool = False  # decided from a gateway process's lease (quota/leases.py): settled in that process only


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reservation: Reservation | None
    reason: str | None = None  # one of REASONS when refused
    scope: str | None = None  # the scope that refused
    retry_after_s: float | None = None  # None when it can never fit
    headers: Mapping[str, str] = field(default_factory=dict)  # x-ratelimit-*, + retry-after(-ms) when refused


@dataclass(frozen=True)
class Remaining:
    """What one scope has left right now (None: unlimited on that dimension). For inspection and tests."""

    requests: float | None  # RPM bucket level
    tokens: float | None  # TPM bucket level; below zero is debt from requests that used more than they reserved
    concurrent: int | None  # free concurrency slots
    tokens_today: int | None  # daily budget left


class QuotaUnavailable(Exception):
    """The quota store is down and the tier's policy says fail closed: the gateway answers 503."""


class QuotaStoreError(ConnectionError):
    """The quota store could not be reached in time (connection refused or lost, timeout)."""


class QuotaService(Protocol):
    async def reserve(self, request_id: str, scopes: Sequence[Scope], tokens: int, tier: str = "default") -> Decision:
        """Reserves one request and `tokens` tokens in every scope, or nothing at all."""

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        """Settles a finished, cancelled or failed request: refunds or charges the difference, frees its slot.
        Idempotent per request id."""

    async def extend(self, reservation: Reservation, at_least: int, at_most: int) -> Reservation | None:
        """Reserves more tokens for a running request: as many as every scope's daily budget and tokens-per-minute
        bucket allow, up to `at_most`, or nothing when that is under `at_least`. Returns the grown reservation, or
        None (refused, or already reconciled). Only tokens: its request and concurrency slot stay as they are."""

    async def close(self) -> None: ...


def check_reserve(request_id: str, scopes: Sequence[Scope], tokens: int) -> tuple[Scope, ...]:
    """The arguments of reserve, validated; raises ValueError."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    if isinstance(scopes, (str, bytes)):
        raise ValueError("scopes must be a sequence of Scope")
    scopes = tuple(scopes)
    if not scopes:
        raise ValueError("a request needs at least one scope")
    if not all(isinstance(s, Scope) for s in scopes):
        raise ValueError("scopes must be Scope records")
    if len({s.tenant for s in scopes}) > 1:
        raise ValueError(f"all scopes of a request must share one tenant, got {sorted({s.tenant for s in scopes})}")
    if len({s.name for s in scopes}) < len(scopes):
        raise ValueError("a scope appears twice in one request")
    check_tokens(tokens, "tokens")
    return scopes


def check_extend(reservation: Reservation, at_least: int, at_most: int) -> None:
    check_reservation(reservation, 0)
    check_tokens(at_least, "at_least")
    check_tokens(at_most, "at_most")
    if not 1 <= at_least <= at_most:
        raise ValueError(f"an extension needs 1 <= at_least <= at_most, got {at_least} and {at_most}")


def check_tokens(value: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be a whole number, got {value!r}")
    if not 0 <= value <= MAX_TOKENS:
        raise ValueError(f"{what} must be between 0 and {MAX_TOKENS}, got {value}")


def check_reservation(reservation: Reservation, used_tokens: int) -> None:
    if not isinstance(reservation, Reservation):
        raise ValueError(f"expected a Reservation, got {type(reservation).__name__}")
    check_tokens(used_tokens, "used_tokens")
