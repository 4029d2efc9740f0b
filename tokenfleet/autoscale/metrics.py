"""The autoscaler's inputs and decision as Prometheus metrics, one series per pool (labels: the model, and the
router's pool, i.e. the region), read at scrape time from the last decision. KEDA or a Horizontal Pod Autoscaler
scales a replica Deployment on `max(tokenfleet_autoscale_desired_replicas{model="...", pool="..."})`: every
gateway exports a decision; with a fleet's Redis they all decide on the same totals (autoscale.shared), and the
max covers the moment between their steps."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Protocol

from tokenfleet.autoscale.policy import Decision
from tokenfleet.autoscale.signals import PoolSignals
from tokenfleet.metric_families import counter_family, gauge_family

LABELS = ["model", "pool"]

# name -> (help, value from the pool's signals)
SIGNAL_GAUGES = {
    "tokenfleet_autoscale_ready_replicas": ("Replicas taking requests.", lambda s: s.ready),
    "tokenfleet_autoscale_starting_replicas": ("Replicas launched and not serving yet.", lambda s: s.starting),
    "tokenfleet_autoscale_draining_replicas": (
        "Replicas finishing their requests, taking no new ones.",
        lambda s: s.draining,
    ),
    "tokenfleet_autoscale_queued_requests": (
        "Interactive requests waiting for room at the gateway.",
        lambda s: s.queued_requests,
    ),
    "tokenfleet_autoscale_queued_tokens": (
        "Prefill tokens waiting, at the gateway and on the replicas.",
        lambda s: s.queued_tokens,
    ),
    "tokenfleet_autoscale_in_flight_requests": (
        "Requests on the replicas (running or waiting there).",
        lambda s: s.in_flight,
    ),
    "tokenfleet_autoscale_batch_in_flight_requests": (
        "Batch-tier requests on the replicas.",
        lambda s: s.batch_in_flight,
    ),
    "tokenfleet_autoscale_kv_usage": ("Mean KV-cache usage of the ready replicas (0-1).", lambda s: s.kv_usage_mean),
    "tokenfleet_autoscale_kv_usage_max": (
        "Highest KV-cache usage among the ready replicas (0-1).",
        lambda s: s.kv_usage_max,
    ),
    "tokenfleet_autoscale_projected_ttft_seconds": (
        "Projected time to first token of a new request.",
        lambda s: s.projected_ttft_s,
    ),
    "tokenfleet_autoscale_arrival_rate": (
        "Interactive requests arriving per second (smoothed).",
        lambda s: s.arrival_rate,
    ),
}
DECISION_GAUGES = {
    "tokenfleet_autoscale_desired_replicas": (
        "Replicas the autoscaler wants serving in the pool.",
        lambda d: d.desired,
    ),
    "tokenfleet_autoscale_need_replicas": (
        "Replicas the signals call for (fractional, before the warm buffer, min and max).",
        lambda d: d.need,
    ),
    "tokenfleet_autoscale_spare_replicas": (
        "Ready replicas beyond the interactive need: room for the batch tier.",
        lambda d: d.spare_replicas,
    ),
    "tokenfleet_autoscale_batch_allowed": (
        "1 when the batch tier may run (the trough).",
        lambda d: int(d.batch_allowed),
    ),
    "tokenfleet_autoscale_batch_tokens_per_second": (
        "The batch tier's pace in the trough: the spare replicas' prefill rate (0 outside it).",
        lambda d: d.batch_tokens_per_s,
    ),
    "tokenfleet_autoscale_forecast_rate": (
        "The forecast's peak arrival rate (requests/s) over the cold-start look-ahead.",
        lambda d: d.forecast_rps,
    ),
}


class Source(Protocol):
    signals: Mapping[str, PoolSignals]
    decisions: Mapping[str, Decision]
    events: Counter  # (pool key, "up" | "down") -> changes of the desired count


class AutoscaleCollector:
    """Registered in the gateway's registry, so the series appear on its /metrics."""

    def __init__(self, source: Source) -> None:
        self.source = source

    def collect(self):
        signals, decisions = dict(self.source.signals), dict(self.source.decisions)
        labels = {key: (s.model or key, s.region) for key, s in signals.items()}
        for name, (doc, value) in SIGNAL_GAUGES.items():
            yield gauge_family(name, doc, {labels[key]: value(s) for key, s in signals.items()}, LABELS)
        for name, (doc, value) in DECISION_GAUGES.items():
            values = {labels[key]: value(d) for key, d in decisions.items() if key in labels and value(d) is not None}
            yield gauge_family(name, doc, values, LABELS)
        events = {(*labels[key], direction): n for (key, direction), n in self.source.events.items() if key in labels}
        yield counter_family(
            "tokenfleet_autoscale_scale_events",
            "Changes of the desired replica count, by direction.",
            events,
            [*LABELS, "direction"],
        )
