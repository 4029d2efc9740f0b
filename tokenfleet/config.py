"""Typed configuration: the engine's options (the same names as vLLM's engine arguments where they exist), and the
fleet file (fleet.yaml) the gateway reads: model, replicas, streams, tenants' tiers, quotas, dispatch."""
from __future__ import annotations

import argparse
import os
import typing
from typing import TYPE_CHECKING
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

import yaml

from tokenfleet.autoscale.settings import AutoscaleSettings
from tokenfleet.conversations.settings import ConversationSettings
from tokenfleet.dispatch.overload import OverloadSettings
from tokenfleet.quota.limits import Limits
from tokenfleet.router.catalog import ModelSpec, PoolSpec, RoutingRule
from tokenfleet.router.health import HealthSettings
from tokenfleet.router.router import Canary, RoutingSettings, Shadow

if TYPE_CHECKING:
    import torch


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto = the checkpoint's dtype; or float32 / bfloat16 / float16
    device: str = "auto"  # auto = cuda when present, else cpu
    max_model_len: int | None = None  # defaults to the model's context window
    block_size: int = 16
    kv_cache_gib: float = 2.0  # KV cache budget on CPU
    gpu_memory_utilization: float = 0.9  # fraction of free GPU memory the KV cache may take
    swap_space_gib: float = 1.0  # host memory for swapped-out KV blocks
    swap_threshold_tokens: int = 512  # preempted sequences this long are swapped, shorter ones recomputed
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    watermark: float = 0.01  # fraction of blocks kept free when admitting, headroom for running sequences
    enable_prefix_caching: bool = True
    skip_tokenizer_init: bool = False
    threads: int = 0  # PyTorch threads; 0 = auto (servers: every usable core but one; offline: PyTorch's default)
    engine_process: bool = True  # servers: the engine steps in its own process, not on a thread beside the HTTP loop

    @classmethod
    def from_options(cls, model: str, **options) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(model=model, **options)

    def resolved_device(self) -> "torch.device":
        import torch  # here, so the gateway's configuration does not load PyTorch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def add_engine_arguments(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    """One --flag per EngineConfig field (underscores become dashes), with the field's default and type."""
    hints = typing.get_type_hints(EngineConfig)
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if f.name == "model":
            parser.add_argument(flag, required=model_required, default=None, help="Hugging Face checkpoint folder")
        elif kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
            default = None if f.default is MISSING else f.default
            parser.add_argument(flag, type=base, default=default, help=f"default: {default}")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


# --- the fleet file --------------------------------------------------------------------------------------------


@dataclass
class StreamSettings:
    ping_interval_s: float = 15.0
    send_timeout_s: float = 10.0
    max_lag_events: int = 2048  # a reader further behind than this is cut off (it can resume)
    disconnect_grace_s: float = 5.0  # a dropped stream nobody resumes within this is cancelled


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


@dataclass
class QuotaSettings:
    backend: str = "auto"  # redis | memory; auto: redis when the fleet has a redis_url
    prefix: str = "tokenfleet:quota:"
    timeout_s: float = 0.25  # a Redis call slower than this counts as an outage (see TierConfig.on_quota_outage)
    retry_after_outage_s: float = 1.0  # after a failure, decide locally this long before trying Redis again
    hot_tenants: dict[str, int] = field(default_factory=dict)  # organisation id -> sub-buckets (slices)
    slice_index: int = 0  # which slice of a hot tenant's buckets this gateway draws from
    rebalance_interval_s: float = 5.0

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "redis", "memory"):
            raise ValueError(f"backend must be auto, redis or memory, got {self.backend!r}")
        if not self.timeout_s > 0 or not self.retry_after_outage_s >= 0 or not self.rebalance_interval_s > 0:
            raise ValueError("timeout_s and rebalance_interval_s must be positive, retry_after_outage_s >= 0")
        bad = {k: v for k, v in self.hot_tenants.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"hot_tenants: each tenant needs a whole number of slices >= 1, got {bad}")


@dataclass
class DispatchSettings:
    slots_per_replica: int = 64  # requests a replica runs at once before the gateway queues by tier
    quantum_tokens: int = 2048  # deficit round-robin quantum across tenants of a tier
    load_interval_s: float = 1.0  # how often replica load reports are read
    prefill_tokens_per_s: float = 4000.0  # one replica's prefill rate, to project time to first token

    def __post_init__(self) -> None:
        if self.slots_per_replica < 1 or self.quantum_tokens < 1:
            raise ValueError("slots_per_replica and quantum_tokens must be at least 1")
        if not self.load_interval_s > 0 or not self.prefill_tokens_per_s > 0:
            raise ValueError("load_interval_s and prefill_tokens_per_s must be positive")


@dataclass
class MeteringSettings:
    """Usage events: outbox (the tenants' database) -> event log (a Redis Stream in a fleet) -> warehouse table."""

    stream_key: str = "tokenfleet:usage"  # the Redis Stream
    group: str = "warehouse"  # its consumer group
    consumer: str = ""  # this gateway's warehouse writer; default: the host name (a restart resumes its entries)
    write_warehouse: bool = True  # run a warehouse writer here (a fleet may run fewer writers than gateways)
    lease_s: float = 30.0  # a request's open row outlives a dead gateway this long, then is closed as failed
    checkpoint_s: float = 2.0  # how often running requests' counts are saved and their leases renewed
    batch_s: float = 0.002  # outbox opens and closes that queue within this share one transaction (group commit)
    ship_interval_s: float = 0.5
    keep_sent_s: float = 3600.0  # shipped outbox rows are purged after this

    def __post_init__(self) -> None:
        if not 0 < self.checkpoint_s < self.lease_s:
            raise ValueError("need 0 < checkpoint_s < lease_s")
        if not 0 <= self.batch_s < self.checkpoint_s:
            raise ValueError("need 0 <= batch_s < checkpoint_s")
        if not self.ship_interval_s > 0 or not self.keep_sent_s > 0:
            raise ValueError("ship_interval_s and keep_sent_s must be positive")


@dataclass
class BillingSettings:
    """Prices per million tokens by model (the key "*" for models not named), and what one replica costs per hour
    (a GPU, or a CPU host), from which the cost of a million output tokens is derived."""

    replica_hour_usd: float = 0.0
    prices: dict = field(default_factory=dict)  # model -> {input, cached_input, output}, USD per 1M tokens

    def __post_init__(self) -> None:
        from tokenfleet.billing.prices import PriceTable

        if self.replica_hour_usd < 0:
            raise ValueError("replica_hour_usd must be >= 0")
        self.table = PriceTable.from_dict(self.prices)


def section(cls, raw: dict | None, where: str):
    """A settings dataclass from its YAML mapping; unknown keys and bad values are start-up errors naming `where`."""
    raw = dict(raw or {})
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    raw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    try:
        return cls(**raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def default_tiers() -> dict[str, TierConfig]:
    return {
        "enterprise": TierConfig(0, 8, Limits(6000, 2_000_000, 256), Limits(60_000, 20_000_000, 2048)),
        "paid": TierConfig(0, 4, Limits(600, 200_000, 32), Limits(6000, 2_000_000, 256)),
        "free": TierConfig(1, 2, Limits(20, 20_000, 4, 200_000), Limits(200, 200_000, 40, 2_000_000),
                           on_quota_outage="closed"),
        "batch": TierConfig(2, 1, Limits(60, 500_000, 64), Limits(600, 5_000_000, 512), on_quota_outage="closed"),
    }


def tiers_from_dict(raw: dict | None) -> dict[str, TierConfig]:
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


def routing_from_dict(raw: dict | None, where: str) -> RoutingSettings:
    """`routing:` in fleet.yaml: the policy and its bound, health checks, product rules, canaries, shadows."""
    raw = dict(raw or {})
    try:
        health = section(HealthSettings, raw.pop("health", None), f"{where}.health")
        rules = {alias: [RoutingRule(**r) for r in rules] for alias, rules in (raw.pop("rules", None) or {}).items()}
        canary = [Canary(**c) for c in raw.pop("canary", None) or []]
        shadow = [Shadow(**s) for s in raw.pop("shadow", None) or []]
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from None
    settings = section(RoutingSettings, raw, where)
    settings.health, settings.rules, settings.canary, settings.shadow = health, rules, canary, shadow
    settings.__post_init__()
    return settings


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
    def load(cls, path: str | Path) -> "FleetConfig":
        raw = yaml.safe_load(Path(path).read_text()) or {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        sections = {name: section(kind, raw.pop(name, None), f"{path}: {name}") for name, kind in (
            ("streams", StreamSettings), ("quota", QuotaSettings), ("dispatch", DispatchSettings),
            ("overload", OverloadSettings), ("metering", MeteringSettings), ("billing", BillingSettings),
            ("autoscale", AutoscaleSettings))}
        tiers = tiers_from_dict(raw.pop("tiers", None))
        sections["conversations"] = section(ConversationSettings, raw.pop("conversations", None),
                                            f"{path}: conversations")
        models = [ModelSpec.from_dict(m, f"{path}: models[{i}]") for i, m in enumerate(raw.pop("models", None) or [])]
        routing = routing_from_dict(raw.pop("routing", None), f"{path}: routing")
        config = cls(**raw, **sections, tiers=tiers, models=models, routing=routing)
        config.database_url = os.environ.get("TOKENFLEET_DATABASE_URL", config.database_url)
        config.redis_url = os.environ.get("TOKENFLEET_REDIS_URL", config.redis_url)  # may hold a password
        config.admin_key = os.environ.get("TOKENFLEET_ADMIN_KEY", config.admin_key)
        config.resume_secret = os.environ.get("TOKENFLEET_RESUME_SECRET", config.resume_secret)
        for name in (*config.overload.batch_tiers, *config.overload.free_tiers):
            if name not in config.tiers:
                raise ValueError(f"{path}: overload names tier {name!r}, which is not among the tiers "
                                 f"({', '.join(config.tiers)})")
        return config
