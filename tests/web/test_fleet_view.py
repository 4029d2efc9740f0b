"""The console's autoscaler rows, read from the autoscaler's own Prometheus collector (as the gateway registers it):
desired from its last decision, ready/starting/draining from the pool's signals, one row per model and pool."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from tokenfleet.autoscale.metrics import AutoscaleCollector
from tokenfleet.autoscale.policy import Decision
from tokenfleet.autoscale.signals import PoolSignals
from tokenfleet.gateway.fleet_view import PoolScaleView, autoscale_view


@dataclass
class LastStep:
    signals: dict = field(default_factory=dict)
    decisions: dict = field(default_factory=dict)
    events: Counter = field(default_factory=Counter)


def test_desired_and_ready_replicas_per_pool_from_the_autoscalers_metrics():
    step = LastStep()
    registry = CollectorRegistry()
    registry.register(AutoscaleCollector(step))
    assert autoscale_view(registry) == []  # no decision yet
    step.signals = {
        "tiny/eu": PoolSignals("tiny/eu", model="tiny", region="eu", ready=2, starting=1, draining=0),
        "tiny/us": PoolSignals("tiny/us", model="tiny", region="us", ready=1, draining=1),
    }
    step.decisions = {"tiny/eu": Decision("tiny/eu", desired=4, reason="queue"), "tiny/us": Decision("tiny/us", 1, "")}
    assert autoscale_view(registry) == [
        PoolScaleView("tiny", "eu", desired=4, ready=2, starting=1, draining=0),
        PoolScaleView("tiny", "us", desired=1, ready=1, starting=0, draining=1),
    ]
