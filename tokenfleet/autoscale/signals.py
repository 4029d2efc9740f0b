"""What the autoscaler looks at, per model pool: replicas ready, starting and draining; work queued at the gateway
and in flight on the replicas; KV-cache usage; the projected time to first token; the arrival rate. Never GPU
utilisation: a saturated batch and a healthy one read the same there.

`PoolSignals` is a plain record, so a simulator can fill it from simulated replicas; `GatewaySignals` reads it from
a running gateway (the router's replicas and their GET /load reports, and the model's fair queue)."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import astuple, dataclass, field

from tokenfleet.dispatch.overload import LoadSignal, projected_ttft_s
from tokenfleet.dispatch.tickets import DispatchSnapshot


@dataclass
class ReplicaSignals:
    """One replica, for choosing whom to drain and seeing when a drained one is empty."""

    name: str
    draining: bool = False
    healthy: bool = True
    running: int = 0  # its last load report
    waiting: int = 0
    in_flight: int = 0  # requests this gateway sent it that have not finished (fresh)
    kv_usage: float = 0.0
    queued_tokens: int = 0  # prefill tokens waiting on it
    started_at: float = 0.0  # newer replicas are drained first (older ones hold warmer prefix caches)
    removable: bool = True  # the orchestrator started it and can stop it

    @property
    def busy(self) -> int:
        return max(self.in_flight, self.running + self.waiting)


def pool_key(model: str, region: str) -> str:
    """The autoscaler's name for one model's replicas in one of the router's pools (a region): what one
    Kubernetes Deployment runs."""
    return f"{model}/{region}"


@dataclass
class PoolSignals:
    """One pool now: a model's replicas in one region pool. Request counts are interactive work unless named
    batch: the batch tier fills spare capacity and must not make the pool grow."""

    pool: str  # its key (pool_key from a gateway; any name in a simulation)
    model: str = ""  # the model it serves ("": the key is the model's name)
    region: str = "default"  # the router's pool (region) its replicas are in
    ready: int = 0  # taking requests (healthy, not draining)
    starting: int = 0  # launched, not serving yet
    draining: int = 0  # finishing their requests, taking no new ones
    queued_requests: int = 0  # waiting for room in the gateway's fair queue
    queued_tokens: int = 0  # prefill tokens waiting: in the fair queue and on the replicas
    in_flight: int = 0  # requests on the replicas (running or waiting there), batch included
    batch_in_flight: int = 0  # of which batch tier
    batch_queued: int = 0  # batch requests waiting in the fair queue (paused or not)
    kv_usage_mean: float = 0.0  # over ready replicas, 0..1
    kv_usage_max: float = 0.0
    projected_ttft_s: float = 0.0  # queued prefill at the pool's prefill rate (dispatch.overload.projected_ttft_s)
    arrival_rate: float = 0.0  # interactive requests/s, smoothed
    replicas: list[ReplicaSignals] = field(default_factory=list)  # optional: without them nothing is drained
    unavailable: int = 0  # in the pool but neither ready nor draining (ejected by health checks)
    stopping: int = 0  # stopped by the orchestrator: out of the router, its process still running
    prefill_tokens_per_s: float = 0.0  # one replica's prefill rate (0: unknown)

    @property
    def interactive_demand(self) -> int:
        return max(0, self.in_flight - self.batch_in_flight) + self.queued_requests

    @property
    def occupied(self) -> int:
        """Replicas that hold a machine now, for a shared budget."""
        return self.ready + self.starting + self.draining + self.unavailable + self.stopping


class RateMeter:
    """Requests/s from a growing count, smoothed exponentially over `window_s`."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._last: dict[str, tuple[float, int]] = {}
        self._rate: dict[str, float] = {}

    def update(self, key: str, count: int, now: float) -> float:
        last = self._last.get(key)
        self._last[key] = (now, count)
        if last is None or now <= last[0]:
            return self._rate.get(key, 0.0)
        dt = now - last[0]
        instant = max(0, count - last[1]) / dt
        weight = 1.0 - math.exp(-dt / self.window_s)
        rate = self._rate[key] = self._rate.get(key, instant) * (1 - weight) + instant * weight
        return rate


def dispatch_split(snapshot: DispatchSnapshot, batch_tiers: Collection[str]) -> dict[str, int]:
    """A model's fair-queue snapshot split into interactive work (queued, queued tokens, arrivals so far) and batch
    work (queued, holding slots)."""
    tiers = snapshot.tiers.items()
    return {
        "queued": sum(t.queued for n, t in tiers if n not in batch_tiers),
        "queued_tokens": sum(t.queued_tokens for n, t in tiers if n not in batch_tiers),
        "batch_queued": sum(t.queued for n, t in tiers if n in batch_tiers),
        "batch_in_use": sum(t.in_use for n, t in tiers if n in batch_tiers),
        "arrivals": sum(t.dispatched + t.cancelled + t.queued for n, t in tiers if n not in batch_tiers),
    }


@dataclass
class GatewayShare:
    """One gateway's part of a pool's signals: what waits in its fair queue, the batch work holding its dispatch
    slots, its interactive arrival rate. The replicas' reports (in flight, KV usage, queued prefill) are the same
    from every gateway; these are not, so gateways add up their shares (autoscale.shared)."""

    queued: int = 0  # interactive requests waiting
    queued_tokens: int = 0  # ... and their prompt tokens
    batch_queued: int = 0
    batch_in_use: int = 0  # dispatch slots held by batch requests
    in_use: int = 0  # dispatch slots held, every tier
    slots: int = 0
    arrival_rate: float = 0.0  # interactive requests/s, smoothed

    def __add__(self, other: GatewayShare) -> GatewayShare:
        return GatewayShare(*(a + b for a, b in zip(astuple(self), astuple(other))))


def gateway_share(
    snapshot: DispatchSnapshot, batch_tiers: Collection[str], rates: RateMeter, key: str, now: float
) -> GatewayShare:
    """A gateway's share from its fair queue's snapshot; `rates` turns the queue's arrivals so far into a rate."""
    split = dispatch_split(snapshot, batch_tiers)
    return GatewayShare(
        split["queued"],
        split["queued_tokens"],
        split["batch_queued"],
        split["batch_in_use"],
        snapshot.in_use,
        snapshot.slots,
        rates.update(key, split["arrivals"], now),
    )


def add_shares(*shares: Mapping[str, GatewayShare]) -> dict[str, GatewayShare]:
    """Pool key -> the sum of the given gateways' shares of it."""
    total: dict[str, GatewayShare] = {}
    for by_pool in shares:
        for key, share in by_pool.items():
            total[key] = total[key] + share if key in total else share
    return total


def replica_signals(replicas, health, owned: Mapping[str, float]) -> list[ReplicaSignals]:
    """The router's view of some replicas (router.pool.Replica) of one model."""
    out = []
    for r in replicas:
        s = r.state
        out.append(
            ReplicaSignals(
                r.name,
                r.draining,
                health.available(r.name),
                s.running,
                s.waiting,
                s.in_flight,
                s.kv_usage,
                s.queued_tokens,
                owned.get(r.name, 0.0),
                r.name in owned,
            )
        )
    return out


def pool_signals(
    key: str, replicas: list[ReplicaSignals], share: GatewayShare | None, prefill_tokens_per_s: float, starting: int = 0
) -> PoolSignals:
    """One pool's signals from its replicas and, for a pool gateways' fair queues feed, their share."""
    ready = [r for r in replicas if not r.draining and r.healthy]
    share = share or GatewayShare()
    replica_tokens = sum(r.queued_tokens for r in replicas)
    kv = [r.kv_usage for r in ready]
    ttft = projected_ttft_s(
        LoadSignal(share.queued_tokens, replica_tokens, share.in_use, share.slots, prefill_tokens_per_s * len(ready))
    )
    return PoolSignals(
        pool=key,
        ready=len(ready),
        starting=starting,
        draining=sum(r.draining for r in replicas),
        queued_requests=share.queued,
        queued_tokens=share.queued_tokens + replica_tokens,
        in_flight=_in_flight(replicas),
        batch_in_flight=share.batch_in_use,
        batch_queued=share.batch_queued,
        kv_usage_mean=sum(kv) / len(kv) if kv else 0.0,
        kv_usage_max=max(kv, default=0.0),
        projected_ttft_s=ttft,
        arrival_rate=share.arrival_rate,
        replicas=replicas,
        unavailable=sum(not r.draining and not r.healthy for r in replicas),
        prefill_tokens_per_s=prefill_tokens_per_s,
    )


def _in_flight(replicas: list[ReplicaSignals]) -> int:
    """This gateway's own count (fresh) or the replicas' reports (every gateway's, a load interval old), whichever
    is higher, over the pool as a whole: per replica, a request that just moved from one replica to another would
    be counted twice (the old one's stale report and the new one's fresh count)."""
    return max(sum(r.in_flight for r in replicas), sum(r.running + r.waiting for r in replicas))


class GatewaySignals:
    """Reads the signals of every pool (model x region) from a gateway's router and admission. A model's fair
    queue is shared by its regions: what waits there is counted against the nearest region, where it would go."""

    def __init__(
        self, router, admission, batch_tiers: Collection[str], prefill_tokens_per_s: float, rate_window_s: float = 60.0
    ) -> None:
        self.router, self.admission = router, admission
        self.batch_tiers, self.prefill_tokens_per_s = tuple(batch_tiers), prefill_tokens_per_s
        self.rates = RateMeter(rate_window_s)

    def shares(self, now: float) -> dict[str, GatewayShare]:
        """This gateway's share of each model's nearest pool (where its fair queue sends work)."""
        out = {}
        for model, pools in self.router.models.items():
            snapshot = self.admission.dispatchers[model].snapshot()
            out[pool_key(model, nearest_region(pools))] = gateway_share(
                snapshot, self.batch_tiers, self.rates, model, now
            )
        return out

    def read(
        self,
        shares: Mapping[str, GatewayShare],
        starting: Mapping[str, int] | None = None,
        owned: Mapping[str, float] | None = None,
        stopping: Mapping[str, int] | None = None,
    ) -> dict[str, PoolSignals]:
        """`shares`: pool key -> the gateways' share (this one's, or every live gateway's added up); `starting`:
        pool key -> replicas launched and not yet in the router; `owned`: replica name -> start time, for the
        replicas the orchestrator can stop; `stopping`: pool key -> replicas stopped whose process still runs."""
        starting, stopping, out = starting or {}, stopping or {}, {}
        for model, pools in self.router.models.items():
            for region in regions(pools, {**stopping, **starting}):
                key = pool_key(model, region)
                members = [r for r in pools.replicas.values() if r.pool == region]
                signals = pool_signals(
                    key,
                    replica_signals(members, pools.health, owned or {}),
                    shares.get(key),
                    self.prefill_tokens_per_s,
                    starting.get(key, 0),
                )
                signals.model, signals.region, signals.stopping = model, region, stopping.get(key, 0)
                out[key] = signals
        return out


def nearest_region(pools) -> str:
    """The model's configured pool with the lowest latency from this gateway (router.pool.ModelPools)."""
    return min(pools.spec.pools, key=lambda p: (p.latency_ms, p.name)).name


def regions(pools, starting: Mapping[str, int]) -> list[str]:
    """A model's pools: configured, holding replicas, or with replicas starting."""
    names = {p.name for p in pools.spec.pools} | {r.pool for r in pools.replicas.values()}
    names |= {key.rsplit("/", 1)[1] for key in starting if key.rsplit("/", 1)[0] == pools.spec.name}
    return sorted(names)
