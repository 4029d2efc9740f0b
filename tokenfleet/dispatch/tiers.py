"""Service tiers (`tiers:` in fleet.yaml): each tier's priority class, fair-queuing weight and default limits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenfleet.quota.limits import Limits


@dataclass(frozen=True)
class TierConfig:
    """A service tier: its engine priority class (lower runs first and is preempted last, as in vLLM), its weight in
    fair queuing, default limits per user and per organisation, and what to do when the quota store is down."""

    priority: int
    weight: int
    user_limits: Limits = Limits()
    org_limits: Limits = Limits()
    on_quota_outage: str = "open"  # open: admit under a local in-memory limiter; closed: 503
    typical_output_tokens: int = 256  # reserved for output when a request gives no max_tokens

    def __post_init__(self) -> None:
        if self.weight < 1:
            raise ValueError(f"weight must be at least 1, got {self.weight}")
        if self.on_quota_outage not in ("open", "closed"):
            raise ValueError(f"on_quota_outage must be open or closed, got {self.on_quota_outage!r}")
        if self.typical_output_tokens < 1:
            raise ValueError(f"typical_output_tokens must be positive, got {self.typical_output_tokens}")


def default_tiers() -> dict[str, TierConfig]:
    return {
        "enterprise": TierConfig(0, 8, Limits(6000, 2_000_000, 256), Limits(60_000, 20_000_000, 2048)),
        "paid": TierConfig(0, 4, Limits(600, 200_000, 32), Limits(6000, 2_000_000, 256)),
        "free": TierConfig(
            1, 2, Limits(20, 20_000, 4, 200_000), Limits(200, 200_000, 40, 2_000_000), on_quota_outage="closed"
        ),
        "batch": TierConfig(2, 1, Limits(60, 500_000, 64), Limits(600, 5_000_000, 512), on_quota_outage="closed"),
    }


def tiers_from_dict(raw: Mapping[str, Any] | None) -> dict[str, TierConfig]:
    """`tiers:` in fleet.yaml; a tier named there replaces the default of that name, new names add tiers."""
    tiers = default_tiers()
    for name, spec in (raw or {}).items():
        spec = dict(spec or {})
        where = f"tiers.{name}"
        user_limits = Limits.from_dict(spec.pop("user_limits", None), f"{where}.user_limits")
        org_limits = Limits.from_dict(spec.pop("org_limits", None), f"{where}.org_limits")
        try:
            tiers[name] = TierConfig(user_limits=user_limits, org_limits=org_limits, **spec)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
    return tiers
