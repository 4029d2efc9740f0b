"""A gateway built by the real wiring (gateway.main.build_gateway) over stand-in replicas, driven in process."""

from __future__ import annotations

from tokenfleet.commands.serve import build_gateway
from tokenfleet.config import FleetConfig, MeteringSettings, StreamSettings
from tokenfleet.gateway.gateway import Gateway, ModelInfo
from tokenfleet.gateway.resume import MemoryResumeBuffer
from tokenfleet.model.tokenizer import Tokenizer
from tokenfleet.router.catalog import ModelSpec

MODEL = "tiny"


def inprocess_gateway(
    model_dir,
    upstreams: list,
    open_tier: str = "local",
    buffer=None,
    quota=None,
    database_url: str | None = None,
    metering: MeteringSettings | None = None,
    **stream_settings,
) -> Gateway:
    """One model, `upstreams` as its replicas (named by their .name), an open gateway whose single user is on
    `open_tier` (the default "local" has no limits; name a configured tier such as "free" to get its limits).
    With a database_url it meters usage (its services must run: see `running_services`)."""
    config = FleetConfig(
        MODEL,
        str(model_dir),
        streams=StreamSettings(**stream_settings),
        database_url=database_url,
        metering=metering or MeteringSettings(),
    )
    info = ModelInfo(MODEL, Tokenizer.from_dir(model_dir), 512)
    gateway, _ = build_gateway(
        config, {MODEL: info}, lambda url, name, kind: None, open_tier, buffer or MemoryResumeBuffer()
    )
    for upstream in upstreams:
        gateway.router.models[MODEL].add(upstream.name, "", "default", "tokenfleet", lambda url, name, u=upstream: u)
    if quota is not None:
        gateway.admission.quota = quota
    return gateway


def multi_model_gateway(model_dir, replicas: dict[str, list], open_tier: str = "local", **config) -> Gateway:
    """Several models (all on the same checkpoint), `replicas[name]` serving each; `config` are FleetConfig
    fields (overload, routing, ...)."""
    tokenizer = Tokenizer.from_dir(model_dir)
    specs = [ModelSpec(name, str(model_dir)) for name in replicas]
    fleet = FleetConfig(models=specs, **config)
    infos = {name: ModelInfo(name, tokenizer, 512) for name in replicas}
    gateway, _ = build_gateway(fleet, infos, lambda url, name, kind: None, open_tier, MemoryResumeBuffer())
    for model, upstreams in replicas.items():
        for upstream in upstreams:
            gateway.router.models[model].add(
                upstream.name, "", "default", "tokenfleet", lambda url, name, u=upstream: u
            )
    return gateway
