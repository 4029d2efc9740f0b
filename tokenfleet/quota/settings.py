"""`quota:` in fleet.yaml: which backend decides, and how a Redis outage is treated."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class QuotaSettings:
    backend: str = "auto"  # redis | memory; auto: redis when the fleet has a redis_url
    prefix: str = "tokenfleet:quota:"
    timeout_s: float = 0.25  # a Redis call slower than this counts as an outage (see TierConfig.on_quota_outage)
    retry_after_outage_s: float = 1.0  # after a failure, decide locally this long before trying Redis again
    hot_tenants: dict[str, int] = field(default_factory=dict)  # organisation id -> sub-buckets (slices)
    slice_index: int = 0  # which slice of a hot tenant's buckets this gateway draws from
    rebalance_interval_s: float = 5.0
    # while a Redis decision is on its way, a caller with ample room at its last one has its replica asked already
    # (gateway/ahead.py); a refused request's replica work is stopped before anything reaches the client
    ask_replica_ahead: bool = True
    # far from its limits, a scope's requests are decided in the gateway process from budget taken from Redis ahead
    # (quota/leases.py): no round trip per decision; limits hold across gateways as without; near a limit (the last
    # quarter of any), every request is decided in Redis
    local_leases: bool = True

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "redis", "memory"):
            raise ValueError(f"backend must be auto, redis or memory, got {self.backend!r}")
        if not self.timeout_s > 0 or not self.retry_after_outage_s >= 0 or not self.rebalance_interval_s > 0:
            raise ValueError("timeout_s and rebalance_interval_s must be positive, retry_after_outage_s >= 0")
        bad = {k: v for k, v in self.hot_tenants.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"hot_tenants: each tenant needs a whole number of slices >= 1, got {bad}")
