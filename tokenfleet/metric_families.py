"""Prometheus metric families built from {label values: value} maps, for the collectors of every component."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


def gauge_family(name: str, doc: str, values: dict, labels: list[str] | None = None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=labels or [])
    for label_values, value in values.items():
        family.add_metric(list(label_values), value)
    return family


def counter_family(name: str, doc: str, values: dict, labels: list[str]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for label_values, value in values.items():
        family.add_metric(list(label_values), value)
    return family
