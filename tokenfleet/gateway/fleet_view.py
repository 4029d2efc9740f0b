"""What the operator console shows of a running gateway, read from the state it already keeps in memory: models and
their replicas (health, breaker, draining, load), the overload ladder, the fair queue per tier, what was shed or
refused, and the autoscaler's last decision. Reading it takes no lock and waits for nothing, so a console polling it
never holds up a request."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from tokenfleet.dispatch.overload import OverloadLadder
from tokenfleet.dispatch.tickets import DispatchSnapshot
from tokenfleet.gateway.gateway import Gateway
from tokenfleet.router.health import CLOSED, HealthTracker
from tokenfleet.router.pool import ModelPools, Replica

LADDER_STEPS = (
    "normal",
    "batch tiers paused",
    "free tier capped and moved to the smaller model",
    "new free requests shed",
    "paid requests queueing",
)
AUTOSCALE_SERIES = {
    "tokenfleet_autoscale_desired_replicas": "desired",
    "tokenfleet_autoscale_ready_replicas": "ready",
    "tokenfleet_autoscale_starting_replicas": "starting",
    "tokenfleet_autoscale_draining_replicas": "draining",
}


@dataclass
class ReplicaView:
    name: str
    url: str
    pool: str
    kind: str
    healthy: bool  # breaker closed and its last check or request did not fail
    breaker: str  # closed | open | half_open
    draining: bool
    kv_usage: float  # 0-1, from its last load report
    running: int
    waiting: int
    in_flight: int  # this gateway's requests on it now
    queued_tokens: int
    ttft_p50_s: float | None  # median of its recent first tokens seen by this gateway
    consecutive_failures: int
    ejections: int
    last_failure: str | None


@dataclass
class TierView:
    tier: str
    queued: int
    queued_tokens: int
    in_use: int
    paused: bool
    oldest_wait_s: float
    dispatched: int
    shed: int  # refused by the overload ladder (all models)
    refused: dict[str, int]  # quota refusals by reason (all models)


@dataclass
class ModelView:
    name: str
    aliases: list[str]
    deprecated_on: str | None
    max_model_len: int | None
    pools: list[str]
    slots: int
    in_use: int
    queued: int
    replicas: list[ReplicaView]
    tiers: list[TierView]


@dataclass
class PoolScaleView:
    model: str
    pool: str
    desired: int | None = None
    ready: int | None = None
    starting: int | None = None
    draining: int | None = None


@dataclass
class OverloadView:
    level: int
    meaning: str
    projected_ttft_s: float | None  # None: infinite (work waits and no prefill rate is measured yet)
    ttft_target_s: float


@dataclass
class FleetView:
    overload: OverloadView
    active_streams: int  # generations running now
    models: list[ModelView]
    autoscale: list[PoolScaleView] = field(default_factory=list)  # empty unless autoscaling is on


def fleet_view(gateway: Gateway) -> FleetView:
    admission = gateway.admission
    shed = {tier: count for (tier,), count in admission.shed.items()}
    refused: dict[str, dict[str, int]] = defaultdict(dict)
    for (tier, reason), count in admission.refusals.items():
        refused[tier][reason] = count
    models = []
    for name, pools in gateway.router.models.items():
        dispatcher = admission.dispatchers.get(name)
        snapshot = dispatcher.snapshot() if dispatcher is not None else None
        info = gateway.models.get(name)
        models.append(_model_view(pools, snapshot, info.max_model_len if info else None, shed, refused))
    return FleetView(
        overload_view(admission.ladder),
        sum(1 for relay in list(gateway.relays.values()) if not relay.finished.is_set()),
        models,
        autoscale_view(gateway.metrics.registry),
    )


def overload_view(ladder: OverloadLadder) -> OverloadView:
    ttft = ladder.projected_ttft_s
    return OverloadView(
        ladder.level,
        LADDER_STEPS[ladder.level],
        None if math.isinf(ttft) else round(ttft, 3),
        ladder.settings.ttft_target_s,
    )


def _model_view(
    pools: ModelPools,
    snapshot: DispatchSnapshot | None,
    max_model_len: int | None,
    shed: dict[str, int],
    refused: dict[str, dict[str, int]],
) -> ModelView:
    spec = pools.spec
    tiers = []
    if snapshot is not None:
        for tier, t in snapshot.tiers.items():
            tiers.append(
                TierView(
                    tier,
                    t.queued,
                    t.queued_tokens,
                    t.in_use,
                    t.paused,
                    round(t.oldest_wait_s, 3),
                    t.dispatched,
                    shed.get(tier, 0),
                    dict(refused.get(tier, {})),
                )
            )
    return ModelView(
        spec.name,
        list(spec.aliases),
        spec.deprecated_on.isoformat() if spec.deprecated_on else None,
        max_model_len,
        sorted({p.name for p in spec.pools if p.replicas} | {r.pool for r in pools.replicas.values()}),
        snapshot.slots if snapshot else 0,
        snapshot.in_use if snapshot else 0,
        snapshot.queued if snapshot else 0,
        [replica_view(r, pools.health) for r in list(pools.replicas.values())],
        tiers,
    )


def replica_view(replica: Replica, health: HealthTracker) -> ReplicaView:
    record = health.replicas.get(replica.name)
    breaker = health.state(replica.name) if record is not None else CLOSED
    failures = record.consecutive_failures if record is not None else 0
    s = replica.state
    return ReplicaView(
        replica.name,
        replica.url,
        replica.pool,
        replica.kind,
        breaker == CLOSED and failures == 0,
        breaker,
        replica.draining,
        round(s.kv_usage, 4),
        s.running,
        s.waiting,
        s.in_flight,
        s.queued_tokens,
        _median_ttft(health, replica),
        failures,
        record.ejections if record is not None else 0,
        record.last_failure if record is not None else None,
    )


def _median_ttft(health: HealthTracker, replica: Replica) -> float | None:
    pool = health.pools.get(replica.pool)
    samples = [ttft for name, ttft in pool.ttfts if name == replica.name] if pool is not None else []
    return round(statistics.median(samples), 4) if samples else None


def autoscale_view(registry) -> list[PoolScaleView]:
    """The autoscaler's last decision per pool, as it publishes it on /metrics (nothing when it is off)."""
    pools: dict[tuple[str, str], PoolScaleView] = {}
    for family in registry.collect():
        attribute = AUTOSCALE_SERIES.get(family.name)
        if attribute is None:
            continue
        for sample in family.samples:
            model, pool = sample.labels.get("model", ""), sample.labels.get("pool", "")
            view = pools.setdefault((model, pool), PoolScaleView(model, pool))
            setattr(view, attribute, int(sample.value))
    return [pools[key] for key in sorted(pools)]
