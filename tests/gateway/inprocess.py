"""A gateway built by the real wiring (gateway.main.build_gateway) over stand-in replicas, driven in process."""
from __future__ import annotations

from tokenfleet.config import FleetConfig, StreamSettings
from tokenfleet.gateway.gateway import Gateway, ModelInfo
from tokenfleet.gateway.main import build_gateway
from tokenfleet.gateway.resume import MemoryResumeBuffer
from tokenfleet.model.tokenizer import Tokenizer

MODEL = "tiny"


def inprocess_gateway(model_dir, upstreams: list, open_tier: str = "local", buffer=None, quota=None,
                      **stream_settings) -> Gateway:
    """One model, `upstreams` as its replicas (named by their .name), an open gateway whose single user is on
    `open_tier` (the default "local" has no limits; name a configured tier such as "free" to get its limits)."""
    config = FleetConfig(MODEL, str(model_dir), streams=StreamSettings(**stream_settings))
    info = ModelInfo(MODEL, Tokenizer.from_dir(model_dir), 512)
    gateway, _ = build_gateway(config, {MODEL: info}, lambda url, name, kind: None, open_tier,
                               buffer or MemoryResumeBuffer())
    for upstream in upstreams:
        gateway.router.models[MODEL].add(upstream.name, "", "default", "tokenfleet", lambda url, name, u=upstream: u)
    if quota is not None:
        gateway.admission.quota = quota
    return gateway
