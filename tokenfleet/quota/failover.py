"""Failover: the shared quota store (Redis) first; while it is down, each tier does what its policy says: "open" is
decided by a local in-memory limiter with the same limits, "closed" raises QuotaUnavailable (the gateway answers
503). A circuit breaker skips the store for `breaker_s` after a failure instead of paying a timeout per request,
then lets one request probe it. Reconciles go to the backend holding the reservation; one for the store that
cannot be delivered waits in a pending list and is retried until the store is back (never dropped)."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Mapping, Sequence

from tokenfleet.quota.base import (
    Decision,
    QuotaService,
    QuotaStoreError,
    QuotaUnavailable,
    Reservation,
    Scope,
    check_extend,
    check_reservation,
    check_reserve,
)

log = logging.getLogger("tokenfleet.quota")
POLICIES = ("open", "closed")
# what counts as "the store is down"; anything else (a bug, bad input) propagates
UNREACHABLE = (QuotaStoreError, ConnectionError, TimeoutError)
RETRY_PAUSE_S = 0.1  # the least time between two attempts to deliver pending reconciles


class FailoverQuota:
    name = "failover"

    def __init__(
        self,
        primary: QuotaService,
        fallback: QuotaService,
        policy: Mapping[str, str],
        *,
        breaker_s: float = 1.0,
        default_policy: str = "open",
    ) -> None:
        for tier, value in {**policy, "(default)": default_policy}.items():
            if value not in POLICIES:
                raise ValueError(f"quota outage policy of tier {tier} must be open or closed, got {value!r}")
        if breaker_s < 0:
            raise ValueError(f"breaker_s must be >= 0 (0: no pause, one probe at a time), got {breaker_s}")
        self.primary, self.fallback = primary, fallback
        self.policy, self.default_policy, self.breaker_s = dict(policy), default_policy, breaker_s
        # counters for the gateway's metrics
        self.outages = 0  # times the store went down
        self.fallback_decisions = 0  # decisions made by the local limiter
        self.unavailable = 0  # requests refused with QuotaUnavailable (closed tiers)
        self.reconciles_replayed = 0  # pending reconciles delivered after an outage
        self._pending: collections.deque[tuple[Reservation, int]] = collections.deque()
        self._down_until: float | None = None  # None: the store is healthy
        self._probing = False
        self._retry_task: asyncio.Task[None] | None = None
        self._flushing = asyncio.Lock()  # one flusher at a time, or two would deliver one entry and drop another

    @property
    def pending_reconciles(self) -> int:
        return len(self._pending)

    @property
    def in_outage(self) -> bool:
        return self._down_until is not None

    async def reserve(self, request_id: str, scopes: Sequence[Scope], tokens: int, tier: str = "default") -> Decision:
        check_reserve(request_id, scopes, tokens)
        error: Exception | None = None
        probe = self._may_call_primary()
        if probe is not None:
            try:
                decision = await self.primary.reserve(request_id, scopes, tokens, tier)
                self._healthy()
                return decision
            except UNREACHABLE as e:
                error = e
                self._failed(e)
            finally:
                if probe:
                    self._probing = False
        if self.policy.get(tier, self.default_policy) == "closed":
            self.unavailable += 1
            raise QuotaUnavailable(f"quota store unavailable and tier {tier!r} fails closed") from error
        self.fallback_decisions += 1
        return await self.fallback.reserve(request_id, scopes, tokens, tier)

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        check_reservation(reservation, used_tokens)
        if reservation.backend == getattr(self.fallback, "name", None):
            await self.fallback.reconcile(reservation, used_tokens)
            return
        probe = self._may_call_primary()
        if probe is not None:
            try:
                await self.primary.reconcile(reservation, used_tokens)
                self._healthy()
                return
            except UNREACHABLE as e:
                self._failed(e)
            finally:
                if probe:
                    self._probing = False
        self._pending.append((reservation, used_tokens))
        self._ensure_retry()

    async def extend(self, reservation: Reservation, at_least: int, at_most: int) -> Reservation | None:
        """From the backend holding the reservation; QuotaUnavailable while that is the store and it is down (the
        caller lets the request go on: its reconcile charges what it used)."""
        check_extend(reservation, at_least, at_most)
        if reservation.backend == getattr(self.fallback, "name", None):
            return await self.fallback.extend(reservation, at_least, at_most)
        probe = self._may_call_primary()
        if probe is None:
            raise QuotaUnavailable("quota store unavailable: cannot extend a reservation now")
        try:
            extended = await self.primary.extend(reservation, at_least, at_most)
        except UNREACHABLE as e:
            self._failed(e)
            raise QuotaUnavailable("quota store unavailable: cannot extend a reservation now") from e
        finally:
            if probe:
                self._probing = False
        self._healthy()
        return extended

    async def flush_pending(self) -> int:
        """Delivers pending reconciles in order until one fails; returns how many were delivered."""
        delivered = 0
        async with self._flushing:
            while self._pending:
                reservation, used = self._pending[0]
                try:
                    await self.primary.reconcile(reservation, used)
                except UNREACHABLE as e:
                    self._failed(e)
                    break
                self._pending.popleft()
                delivered += 1
                self.reconciles_replayed += 1
        if delivered and not self._pending:
            self._healthy()
        return delivered

    async def close(self) -> None:
        if self._retry_task is not None:
            self._retry_task.cancel()
            await asyncio.gather(self._retry_task, return_exceptions=True)
        if self._pending:
            await self.flush_pending()
        if self._pending:
            log.error("quota: %d reconciles could not be delivered before shutdown", len(self._pending))
        await self.primary.close()
        await self.fallback.close()

    def _may_call_primary(self) -> bool | None:
        """None: skip the store (breaker open); False: call it; True: call it as the one probe after an outage."""
        if self._down_until is None:
            return False
        if self._probing or time.monotonic() < self._down_until:
            return None
        self._probing = True
        return True

    def _failed(self, error: Exception) -> None:
        if self._down_until is None:
            self.outages += 1
            log.warning(
                "quota store unreachable (%s); open tiers use the local limiter, closed tiers get 503 until it is back",
                error,
            )
        self._down_until = time.monotonic() + self.breaker_s

    def _healthy(self) -> None:
        if self._down_until is not None:
            self._down_until = None
            log.warning("quota store reachable again after an outage; %d reconciles to replay", len(self._pending))
        if self._pending:
            self._ensure_retry()

    def _ensure_retry(self) -> None:
        if self._retry_task is None or self._retry_task.done():
            self._retry_task = asyncio.get_running_loop().create_task(self._retry_pending())

    async def _retry_pending(self) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("the quota failover's retry loop must run as an asyncio task")
        while self._pending and not task.cancelling():
            if self._down_until is not None:
                await asyncio.sleep(max(0.0, self._down_until - time.monotonic()) + 0.01)
                if self._probing:
                    continue
            await self.flush_pending()
            if self._pending:
                await asyncio.sleep(max(self.breaker_s, RETRY_PAUSE_S))
