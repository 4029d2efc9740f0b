"""The gateway's own Prometheus metrics: requests, streams, resumes, cancels, and admission (quota refusals,
the dispatcher's queues by tier, the overload level and what it shed)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenfleet.metric_families import counter_family, gauge_family
from tokenfleet.quota.leases import LeasedQuota

if TYPE_CHECKING:
    from tokenfleet.gateway.admission import Admission


# the dispatcher's figures per model and tier: (family, name, help, value of a tier's snapshot)
PER_TIER = (
    (
        gauge_family,
        "tokenfleet_dispatch_queued_requests",
        "Requests waiting for room, by model and tier.",
        lambda s: s.queued,
    ),
    (
        gauge_family,
        "tokenfleet_dispatch_queued_tokens",
        "Tokens waiting for room, by model and tier.",
        lambda s: s.queued_tokens,
    ),
    (gauge_family, "tokenfleet_dispatch_tier_paused", "1 when the ladder paused the tier.", lambda s: int(s.paused)),
    (
        counter_family,
        "tokenfleet_dispatch_wait_seconds",
        "Time dispatched requests waited for room.",
        lambda s: s.wait_s_total,
    ),
    (counter_family, "tokenfleet_dispatch_tokens", "Tokens dispatched to replicas.", lambda s: s.dispatched_tokens),
)


class GatewayMetrics:
    def __init__(self, active_streams, admission: Admission) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tokenfleet_gateway_requests",
            "Requests by endpoint and status.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.stream_endings = Counter(
            "tokenfleet_gateway_stream_endings", "Client streams by how they ended.", ["how"], registry=self.registry
        )
        self.resumes = Counter(
            "tokenfleet_gateway_resumes", "Streams resumed with Last-Event-ID.", registry=self.registry
        )
        self.cancels = Counter(
            "tokenfleet_gateway_cancels",
            "Generations stopped early: by the cancel API, or abandoned (the client left and did not resume in time).",
            ["reason"],
            registry=self.registry,
        )
        self.shadow_latency = Histogram(
            "tokenfleet_shadow_latency_seconds",
            "Shadow requests to a candidate model: time to first token and end to end (output discarded).",
            ["model", "what"],
            registry=self.registry,
        )
        Gauge(
            "tokenfleet_gateway_active_relays", "Generations being relayed now.", registry=self.registry
        ).set_function(active_streams)
        self.registry.register(AdmissionCollector(admission))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class AdmissionCollector:
    """Reads the admission state at scrape time, so the numbers are never stale and cost nothing between scrapes."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    def collect(self):
        a = self.admission
        yield gauge_family(
            "tokenfleet_overload_level",
            "Degradation ladder step: 0 normal, 1 batch paused, 2 free capped "
            "and moved to the smaller model, 3 free shed, 4 paid queueing.",
            {(): a.ladder.level},
        )
        yield gauge_family(
            "tokenfleet_projected_ttft_seconds",
            "Projected time to first token of a new request.",
            {(): a.ladder.projected_ttft_s},
        )
        snapshots = {model: d.snapshot() for model, d in a.dispatchers.items()}
        yield gauge_family(
            "tokenfleet_dispatch_slots",
            "Room in each model's pool, and how much of it is in use.",
            {
                **{(m, "total"): s.slots for m, s in snapshots.items()},
                **{(m, "in_use"): s.in_use for m, s in snapshots.items()},
            },
            ["model", "state"],
        )
        tiers = [(m, t, ts) for m, s in snapshots.items() for t, ts in s.tiers.items()]
        for family, name, help_text, value in PER_TIER:
            yield family(name, help_text, {(m, t): value(s) for m, t, s in tiers}, ["model", "tier"])
        yield counter_family(
            "tokenfleet_quota_refusals",
            "Requests refused by a quota, by tier and dimension.",
            dict(a.refusals),
            ["tier", "reason"],
        )
        yield counter_family(
            "tokenfleet_overload_shed", "New requests shed by the overload ladder, by tier.", dict(a.shed), ["tier"]
        )
        yield from _quota_store_metrics(a.quota)
        yield from _lease_metrics(getattr(a.quota, "primary", a.quota))


def _quota_store_metrics(quota):
    """Outage counters of a quota kept in Redis with a local fallback (absent when quotas are in memory)."""
    if not hasattr(quota, "outages"):
        return
    yield counter_family(
        "tokenfleet_quota_outages", "Times the quota store became unreachable.", {(): quota.outages}, []
    )
    yield counter_family(
        "tokenfleet_quota_fallback_decisions",
        "Quota decisions made by the local limiter during an outage (tiers that fail open).",
        {(): quota.fallback_decisions},
        [],
    )
    yield counter_family(
        "tokenfleet_quota_unavailable",
        "Requests answered 503 during an outage (tiers that fail closed).",
        {(): quota.unavailable},
        [],
    )
    yield gauge_family(
        "tokenfleet_quota_pending_reconciles",
        "Reconciliations waiting for the quota store to return.",
        {(): quota.pending_reconciles},
    )


def _lease_metrics(quota):
    """What the quota's local leases decided and hold (absent without them)."""
    if not isinstance(quota, LeasedQuota):
        return
    yield counter_family(
        "tokenfleet_quota_local_decisions",
        "Quota decisions made in this process from a lease of the scope's budget.",
        {(): quota.local_decisions},
        [],
    )
    yield gauge_family("tokenfleet_quota_leases", "Leases this process holds.", {(): quota.leases_held})
    yield gauge_family(
        "tokenfleet_quota_lease_free_slots",
        "Concurrency slots this process's leases hold in Redis with no request in them.",
        {(): quota.free_slots},
    )
