"""Autoscaling on queue depth, KV-cache usage and projected TTFT (never GPU utilisation), ahead of a forecast of the
daily curve with a warm buffer; see docs/autoscaling.md. The policy (`Autoscaler.decide`) is pure and clock-injected
so a fleet simulator can drive it; service.py runs it in the gateway, local.py carries it out with processes."""

from tokenfleet.autoscale.forecast import CurveForecast, Forecast, SeasonalForecast
from tokenfleet.autoscale.policy import Autoscaler, Decision, Need, allocate, victims
from tokenfleet.autoscale.settings import AutoscaleSettings, ForecastSpec, LocalSettings, PoolPolicy
from tokenfleet.autoscale.signals import PoolSignals, ReplicaSignals

__all__ = [
    "Autoscaler",
    "AutoscaleSettings",
    "CurveForecast",
    "Decision",
    "Forecast",
    "ForecastSpec",
    "LocalSettings",
    "Need",
    "PoolPolicy",
    "PoolSignals",
    "ReplicaSignals",
    "SeasonalForecast",
    "allocate",
    "victims",
]
