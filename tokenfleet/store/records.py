"""What the tenant store hands out: plain frozen records (never ORM objects, never key hashes), and its errors."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from tokenfleet.quota.limits import Limits


class NotFound(LookupError):
    """No organisation, user or key by that name or id."""


class AlreadyExists(ValueError):
    """A unique name (organisation, or user within its organisation) is taken."""


@dataclass(frozen=True)
class Owner:
    """Whose data (conversations, stored responses): a user of an organisation. Every query is scoped by both."""

    org_id: str
    user_id: str


@dataclass(frozen=True)
class OrgInfo:
    id: str
    name: str
    tier: str
    limits: Limits  # overrides only: a None field means the tier's default
    provisioned_share: float | None
    created_at: datetime


@dataclass(frozen=True)
class UserInfo:
    id: str
    org_id: str
    name: str
    limits: Limits  # overrides only
    created_at: datetime


@dataclass(frozen=True)
class KeyInfo:
    id: str
    org_id: str
    org_name: str
    user_id: str
    user_name: str
    name: str
    prefix: str  # the key's first characters, to recognise it; the rest is never stored
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True)
class Principal:
    """Who a valid API key speaks for. Limits are the stored overrides; the caller fills gaps from the tier."""

    key_id: str
    org_id: str
    org_name: str
    user_id: str
    user_name: str
    tier: str
    org_limits: Limits
    user_limits: Limits
    provisioned_share: float | None
