"""The fleet file (fleet.yaml) the gateway reads: model, replicas, streams, tenants' tiers, quotas, dispatch. Each
section's dataclass lives with the component that reads it; this module composes them. The engine's options are
the engine's own (tokenfleet.engine.config)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from tokenfleet.autoscale.settings import AutoscaleSettings
from tokenfleet.billing.settings import BillingSettings
from tokenfleet.conversations.settings import ConversationSettings
from tokenfleet.dispatch.overload import OverloadSettings
from tokenfleet.dispatch.settings import DispatchSettings
from tokenfleet.dispatch.tiers import TierConfig, default_tiers, tiers_from_dict
from tokenfleet.gateway.settings import StreamSettings
from tokenfleet.metering.settings import MeteringSettings
from tokenfleet.quota.settings import QuotaSettings
from tokenfleet.router.catalog import ModelSpec, PoolSpec
from tokenfleet.router.settings import RoutingSettings, routing_from_dict
from tokenfleet.settings import section

__all__ = [
    "FleetConfig",
    "TierConfig",
    "StreamSettings",
    "QuotaSettings",
    "DispatchSettings",
    "MeteringSettings",
    "BillingSettings",
    "RoutingSettings",
    "default_tiers",
    "section",
]


@dataclass
class FleetConfig:
    """fleet.yaml: the model the gateway serves, its replicas, where streams are kept for resume, and tenancy."""

    model_name: str = ""  # required by `tokenfleet gateway`; `tokenfleet serve` takes its model from flags
    model_path: str = ""  # checkpoint folder (the gateway reads its tokenizer and context window)
    replicas: list[str] = field(default_factory=list)  # replica base URLs
    redis_url: str | None = None  # resume buffer and quotas in Redis (fleet); in memory when absent
    redis_prefix: str = "tokenfleet:stream:"
    resume_ttl_s: int = 300
    host: str = "127.0.0.1"
    port: int = 8000
    drain_timeout_s: float = 30.0
    safety_hook: str | None = None  # package.module:function, see gateway/safety.py
    streams: StreamSettings = field(default_factory=StreamSettings)
    database_url: str | None = None  # tenants and keys: postgresql://… in a fleet, sqlite:///path embedded
    admin_key: str | None = None  # guards /admin/v1/*; the TOKENFLEET_ADMIN_KEY environment variable wins
    tiers: dict[str, TierConfig] = field(default_factory=default_tiers)
    quota: QuotaSettings = field(default_factory=QuotaSettings)
    dispatch: DispatchSettings = field(default_factory=DispatchSettings)
    overload: OverloadSettings = field(default_factory=OverloadSettings)
    resume_secret: str | None = None  # signs resume tokens; give every gateway of a fleet the same one
    models: list[ModelSpec] = field(default_factory=list)  # versions, aliases, pools; or model_name + replicas
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    conversations: ConversationSettings = field(default_factory=ConversationSettings)
    metering: MeteringSettings = field(default_factory=MeteringSettings)
    billing: BillingSettings = field(default_factory=BillingSettings)
    autoscale: AutoscaleSettings = field(default_factory=AutoscaleSettings)

    def served_models(self) -> list[ModelSpec]:
        """`models`, or the one model of the short form (model_name, model_path, replicas)."""
        if self.models:
            return self.models
        if not self.model_name:
            return []
        return [ModelSpec(self.model_name, self.model_path, pools=[PoolSpec("default", list(self.replicas))])]

    @classmethod
    def load(cls, path: str | Path) -> FleetConfig:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        sections = {
            name: section(kind, raw.pop(name, None), f"{path}: {name}")
            for name, kind in (
                ("streams", StreamSettings),
                ("quota", QuotaSettings),
                ("dispatch", DispatchSettings),
                ("overload", OverloadSettings),
                ("metering", MeteringSettings),
                ("billing", BillingSettings),
                ("autoscale", AutoscaleSettings),
            )
        }
        tiers = tiers_from_dict(raw.pop("tiers", None))
        sections["conversations"] = section(
            ConversationSettings, raw.pop("conversations", None), f"{path}: conversations"
        )
        models = [ModelSpec.from_dict(m, f"{path}: models[{i}]") for i, m in enumerate(raw.pop("models", None) or [])]
        routing = routing_from_dict(raw.pop("routing", None), f"{path}: routing")
        config = cls(**raw, **sections, tiers=tiers, models=models, routing=routing)
        config.database_url = os.environ.get("TOKENFLEET_DATABASE_URL", config.database_url)
        config.redis_url = os.environ.get("TOKENFLEET_REDIS_URL", config.redis_url)  # may hold a password
        config.admin_key = os.environ.get("TOKENFLEET_ADMIN_KEY", config.admin_key)
        config.resume_secret = os.environ.get("TOKENFLEET_RESUME_SECRET", config.resume_secret)
        for name in (*config.overload.batch_tiers, *config.overload.free_tiers):
            if name not in config.tiers:
                raise ValueError(
                    f"{path}: overload names tier {name!r}, which is not among the tiers ({', '.join(config.tiers)})"
                )
        return config
