"""fleet.yaml: the shipped example stays valid; mistakes are named."""
from __future__ import annotations

from pathlib import Path

import pytest

from tokenfleet.gateway.main import FleetConfig

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
    with pytest.raises(TypeError, match="ping_every"):
        FleetConfig.load(path)
