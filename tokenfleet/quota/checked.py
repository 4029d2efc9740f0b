"""The front every quota backend shares: each call's arguments checked (ValueError) before the backend's own work,
so that the memory and Redis backends refuse the same mistakes with the same messages."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from tokenfleet.quota.base import Decision, Reservation, Scope, check_extend, check_reservation, check_reserve


class CheckedQuota(ABC):
    """A QuotaService whose backend implements `_reserve`, `_reconcile` and `_extend` on checked arguments."""

    name: str  # what Reservation.backend says, so failover reconciles in the right place

    async def reserve(self, request_id: str, scopes: Sequence[Scope], tokens: int, tier: str = "default") -> Decision:
        return await self._reserve(request_id, check_reserve(request_id, scopes, tokens), tokens)

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        check_reservation(reservation, used_tokens)
        await self._reconcile(reservation, used_tokens)

    async def extend(self, reservation: Reservation, at_least: int, at_most: int) -> Reservation | None:
        check_extend(reservation, at_least, at_most)
        return await self._extend(reservation, at_least, at_most)

    @abstractmethod
    async def _reserve(self, request_id: str, scopes: tuple[Scope, ...], tokens: int) -> Decision:
        """Reserves one request and `tokens` tokens in every scope, or nothing at all (QuotaService.reserve)."""

    @abstractmethod
    async def _reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        """Settles a request, idempotently per request id (QuotaService.reconcile)."""

    @abstractmethod
    async def _extend(self, reservation: Reservation, at_least: int, at_most: int) -> Reservation | None:
        """More tokens for a running request, or None (QuotaService.extend)."""
