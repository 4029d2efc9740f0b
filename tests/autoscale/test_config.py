"""The `autoscale:` section of fleet.yaml and the forecasts: good settings load, impossible ones are clear start-up
errors (also through `tokenfleet gateway`)."""

from __future__ import annotations

import math

import pytest
import yaml

from tokenfleet.autoscale import CurveForecast, SeasonalForecast
from tokenfleet.autoscale.forecast import DAY_S
from tokenfleet.cli import main
from tokenfleet.config import FleetConfig

GOOD = {
    "enabled": True,
    "orchestrator": "local",
    "mode": "forecast",
    "interval_s": 2,
    "cold_start_s": 120,
    "budget": 6,
    "local": {"drain_timeout_s": 10, "log_dir": "/tmp/replicas"},
    "pools": {
        "m": {
            "min_replicas": 2,
            "max_replicas": 5,
            "priority": 1,
            "replica_rps": 4,
            "forecast": {"curve": [[0, 2], [9, 20], [20, 5]]},
            "replica_args": ["--kv-cache-gib", "4"],
        }
    },
}


def write(tmp_path, autoscale: dict):
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({"model_name": "m", "model_path": "/x", "autoscale": autoscale}))
    return path


def test_the_autoscale_section_loads(tmp_path):
    settings = FleetConfig.load(write(tmp_path, GOOD)).autoscale
    assert settings.enabled and settings.orchestrator == "local" and settings.budget == 6
    assert settings.local.drain_timeout_s == 10
    pool = settings.pool("m")
    assert (pool.min_replicas, pool.max_replicas, pool.replica_args) == (2, 5, ("--kv-cache-gib", "4"))
    assert pool.forecast.build().rate(9 * 3600) == 20
    assert settings.pool("other").max_replicas == 4, "models not listed get the defaults"
    assert not FleetConfig().autoscale.enabled, "off unless asked for"


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"pools": {"m": {"min_replicas": 3, "max_replicas": 2}}},
            r"pools.m: min_replicas \(3\) is above max_replicas",
        ),
        ({"pools": {"m": {"target_in_flight": -1}}}, "pools.m: target_in_flight must be a number > 0"),
        ({"pools": {"m": {"target_kv_usage": 1.5}}}, "target_kv_usage must be a number > 0 and <= 1"),
        ({"pools": {"m": {"target_ttft_s": 0}}}, "target_ttft_s must be a number > 0"),
        ({"pools": {"m": {"max_replicas": 0}}}, "max_replicas must be a whole number >= 1"),
        ({"pools": {"m": {"min_replicas": 1.5}}}, "min_replicas must be a whole number"),
        ({"pools": {"m": {"forecast": {"curve": [[0, 5]]}}}}, "a forecast needs replica_rps > 0"),
        ({"pools": {"m": {"replica_rps": 1, "forecast": {"curve": [[25, 5]]}}}}, "hour in 0..24"),
        ({"pools": {"m": {"replica_rps": 1, "forecast": {"curve": [[1, -5]]}}}}, "requests/s >= 0"),
        ({"pools": {"m": {"replica_rps": 1, "forecast": {}}}}, "either curve"),
        ({"pools": {"m": {"replica_rps": 1, "forecast": {"learn": True, "bucket_s": 7}}}}, "bucket_s must divide"),
        ({"pools": {"m": {"max_replica": 3}}}, "pools.m: unknown setting.*max_replica"),
        ({"orchestrator": "kubernetes"}, "orchestrator must be one of none, local"),
        ({"mode": "psychic"}, "mode must be one of forecast, reactive"),
        ({"interval_s": 0}, "interval_s must be a number > 0"),
        ({"cold_start_s": -5}, "cold_start_s must be a number >= 0"),
        ({"warm_buffer": -0.1}, "warm_buffer must be a number >= 0"),
        ({"scale_down_utilization": 1.2}, "scale_down_utilization"),
        ({"budget": 1, "pools": {"m": {"min_replicas": 2}}}, r"budget 1 is below the pools' min_replicas together"),
        ({"local": {"drain_timeout_s": -1}}, "local: drain_timeout_s must be a number >= 0"),
        ({"replicas_max": 3}, "autoscale: unknown setting.*replicas_max"),
    ],
)
def test_impossible_settings_are_clear_start_up_errors(tmp_path, change, message):
    path = write(tmp_path, {"enabled": True, **change})
    with pytest.raises(ValueError, match=message):
        FleetConfig.load(path)


def test_the_gateway_command_refuses_them_before_serving(tmp_path, capsys):
    path = write(tmp_path, {"enabled": True, "pools": {"m": {"min_replicas": 5, "max_replicas": 2}}})
    assert main(["gateway", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert (
        "tokenfleet gateway: error:" in err and "autoscale: pools.m: min_replicas (5) is above max_replicas (2)" in err
    )


def test_a_curve_is_interpolated_and_wraps_at_midnight():
    curve = CurveForecast([(6, 10), (12, 40), (22, 4)])
    assert curve.rate(6 * 3600) == 10 and curve.rate(9 * 3600) == 25 and curve.rate(12 * 3600) == 40
    assert math.isclose(curve.rate(0), 4 + (10 - 4) * 2 / 8), "22:00 -> 06:00 across midnight"
    assert curve.rate(DAY_S + 9 * 3600) == 25, "every day alike"
    short = CurveForecast([(0, 0), (12, 100)], period_s=240)  # a day in four minutes
    assert short.rate(60) == 50 and short.rate(120) == 100


def test_a_learned_profile_predicts_the_next_day():
    truth = CurveForecast([(0, 5), (8, 5), (12, 50), (18, 30)])
    learned = SeasonalForecast(bucket_s=900)
    assert learned.rate(0) is None, "nothing seen yet"
    for t in range(0, int(DAY_S) + 60, 60):  # one day, a reading a minute
        learned.observe(t, truth.rate(t))
    for hour in (3, 9.5, 12, 15, 20):
        t = DAY_S + hour * 3600
        assert math.isclose(learned.rate(t), truth.rate(t), rel_tol=0.1, abs_tol=1), hour
    for t in range(int(DAY_S), int(2 * DAY_S) + 60, 60):  # a day at twice the traffic: halfway there (alpha 0.5)
        learned.observe(t, 2 * truth.rate(t))
    assert math.isclose(learned.rate(2 * DAY_S + 12 * 3600), 1.5 * 50, rel_tol=0.05)
