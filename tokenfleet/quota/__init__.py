"""Token quotas: token buckets per user and organisation behind one interface, in Redis (Lua) or in memory."""

from tokenfleet.quota.base import (
    Decision,
    QuotaService,
    QuotaStoreError,
    QuotaUnavailable,
    Remaining,
    Reservation,
    Scope,
)
from tokenfleet.quota.failover import FailoverQuota
from tokenfleet.quota.limits import Limits
from tokenfleet.quota.memory import MemoryQuota
from tokenfleet.quota.redis import RedisQuota

__all__ = [
    "Decision",
    "FailoverQuota",
    "Limits",
    "MemoryQuota",
    "QuotaService",
    "QuotaStoreError",
    "QuotaUnavailable",
    "RedisQuota",
    "Remaining",
    "Reservation",
    "Scope",
]
