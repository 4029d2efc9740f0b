"""fleet.yaml: the shipped example stays valid; mistakes are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenfleet.config import FleetConfig

EXAMPLE = Path(__file__).parents[2] / "deploy" / "fleet.example.yaml"


def test_example_fleet_config_loads():
    config = FleetConfig.load(EXAMPLE)
    assert config.model_name == "demo" and len(config.replicas) == 2
    assert config.streams.ping_interval_s == 15 and config.redis_url.startswith("redis://")


def test_unknown_settings_are_named(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text("model_name: m\nmodel_path: /x\nreplicas_urls: []\n")
    with pytest.raises(ValueError, match="replicas_urls"):
        FleetConfig.load(path)
    path.write_text("model_name: m\nmodel_path: /x\nstreams: {ping_every: 3}\n")
    with pytest.raises(ValueError, match="streams: unknown setting.*ping_every"):
        FleetConfig.load(path)


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "tiers: {free: {priority: 1, weight: 2, user_limits: {tokens_per_minute: -5}}}",
            "tiers.free.user_limits: tokens_per_minute must be between 0",
        ),
        (
            "tiers: {free: {priority: 1, weight: 2, user_limits: {tokens_per_minute: 1000000000000000}}}",
            "tokens_per_minute must be between 0",
        ),
        ("tiers: {free: {priority: 1, weight: 0}}", "tiers.free: weight must be at least 1"),
        ("tiers: {gold: {priority: 0, weight: 3, on_quota_outage: maybe}}", "on_quota_outage must be open or closed"),
        ("tiers: {free: {priority: 1, weight: 2, user_limits: {tpm: 5}}}", "unknown limit.*tpm"),
        ("tiers: {free: {priority: 1, weight: 2, user_limits: {tokens_per_minute: lots}}}", "whole number"),
        ("quota: {backend: etcd}", "quota: backend must be auto, redis or memory"),
        ("quota: {hot_tenants: {acme: 0}}", "hot_tenants"),
        ("dispatch: {slots_per_replica: 0}", "dispatch: slots_per_replica"),
        (
            "overload: {thresholds: [1.0, 0.5, 2.0, 3.0]}",
            "overload: thresholds must be positive and strictly increasing",
        ),
        ("overload: {free_tiers: [gratis]}", "overload names tier 'gratis'"),
    ],
)
def test_bad_tenancy_settings_are_clear_start_up_errors(tmp_path, text, message):
    path = tmp_path / "fleet.yaml"
    path.write_text(f"model_name: m\nmodel_path: /x\n{text}\n")
    with pytest.raises(ValueError, match=message):
        FleetConfig.load(path)


def test_tiers_override_defaults_and_add_new_ones(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "model_name: m\nmodel_path: /x\ntiers:\n  free: {priority: 1, weight: 3, "
        "user_limits: {tokens_per_minute: 500}}\n  gold: {priority: 0, weight: 6}\n"
    )
    tiers = FleetConfig.load(path).tiers
    assert tiers["free"].weight == 3 and tiers["free"].user_limits.tokens_per_minute == 500
    assert tiers["free"].user_limits.requests_per_minute is None, "a tier given replaces the default whole"
    assert set(tiers) == {"enterprise", "paid", "free", "batch", "gold"}


def test_the_multi_model_example_loads_and_its_catalog_resolves():
    import datetime as dt

    from tokenfleet.router.catalog import ModelCatalog, RequestFacts

    config = FleetConfig.load(EXAMPLE.parent / "fleet.models.example.yaml")
    catalog = ModelCatalog(config.served_models(), config.routing.rules, today=lambda: dt.date(2026, 11, 30))
    assert catalog.resolve("chat-large", RequestFacts(10)).model.name == "chat-large-2026-11-01"
    assert catalog.resolve("auto", RequestFacts(5000)).rule == "long-context"
    assert catalog.resolve("auto", RequestFacts(10, mode="fast")).model.name == "chat-small-2026-10-01"
    assert catalog.resolve("chat-large-2026-06-01", RequestFacts(10)).deprecation is not None
    assert config.served_models()[2].pools[0].kind == "openai"
    assert [p.role for p in config.served_models()[3].pools] == ["prefill", "decode"]


def test_secrets_come_from_the_environment_over_the_file(monkeypatch):
    monkeypatch.setenv("TOKENFLEET_REDIS_URL", "redis://:s3cret@redis:6379/1")
    monkeypatch.setenv("TOKENFLEET_DATABASE_URL", "postgresql://app:pw@db/tokenfleet")
    config = FleetConfig.load(EXAMPLE)
    assert config.redis_url == "redis://:s3cret@redis:6379/1"
    assert config.database_url == "postgresql://app:pw@db/tokenfleet"
