"""`tokenfleet serve` (gateway + in-process replica, one process) and `tokenfleet gateway --config fleet.yaml`."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

from fastapi import FastAPI

from tokenfleet.api.http import configure_logging, run_http
from tokenfleet.config import EngineConfig, FleetConfig, TierConfig, engine_config_from_args
from tokenfleet.engine.async_engine import AsyncEngine
from tokenfleet.dispatch.overload import OverloadLadder
from tokenfleet.dispatch.queue import Dispatcher
from tokenfleet.gateway.admin import add_admin_routes
from tokenfleet.gateway.admission import Admission, watch_load
from tokenfleet.gateway.app import Gateway, ModelInfo, create_gateway_app
from tokenfleet.gateway.auth import Authenticator
from tokenfleet.gateway.resume import MemoryResumeBuffer, RedisResumeBuffer, ResumeBuffer
from tokenfleet.gateway.safety import load_hook
from tokenfleet.gateway.upstream import HttpUpstream, InProcessUpstream, Upstream
from tokenfleet.model.config import ModelConfig
from tokenfleet.model.tokenizer import Tokenizer
from tokenfleet.replica.metrics import load_report
from tokenfleet.quota.base import QuotaService
from tokenfleet.quota.failover import FailoverQuota
from tokenfleet.quota.memory import MemoryQuota
from tokenfleet.quota.redis import RedisQuota
from tokenfleet.replica.server import ReplicaService
from tokenfleet.store.db import Database, migrate, resolve_database_url
from tokenfleet.store.tenants import TenantStore

log = logging.getLogger(__name__)
DEMO_DIR = Path.home() / ".cache" / "tokenfleet" / "demo-model"


def model_info(name: str, path: str, max_model_len: int | None = None) -> ModelInfo:
    window = ModelConfig.from_dir(path).max_model_len
    return ModelInfo(name, Tokenizer.from_dir(path), min(max_model_len or window, window))


def resume_buffer(config: FleetConfig):
    if not config.redis_url:
        return MemoryResumeBuffer(config.resume_ttl_s)
    import redis.asyncio as redis

    return RedisResumeBuffer(redis.from_url(config.redis_url), config.redis_prefix, config.resume_ttl_s)


def quota_service(config: FleetConfig) -> QuotaService:
    """Redis in a fleet (each tier falling back as its on_quota_outage says), in memory embedded."""
    settings = config.quota
    backend = settings.backend if settings.backend != "auto" else ("redis" if config.redis_url else "memory")
    if backend == "memory":
        return MemoryQuota()
    if not config.redis_url:
        raise ValueError("quota.backend is redis but the fleet file has no redis_url")
    redis_quota = RedisQuota.from_url(config.redis_url, settings.prefix, connect_timeout_s=settings.timeout_s,
                                      socket_timeout_s=settings.timeout_s, hot_tenants=settings.hot_tenants,
                                      slice_index=settings.slice_index,
                                      rebalance_interval_s=settings.rebalance_interval_s)
    policy = {name: tier.on_quota_outage for name, tier in config.tiers.items()}
    return FailoverQuota(redis_quota, MemoryQuota(), policy, breaker_s=settings.retry_after_outage_s)


def build_gateway(config: FleetConfig, model: ModelInfo, upstreams: list[Upstream], open_tier: str | None = None,
                  buffer: ResumeBuffer | None = None) -> tuple[Gateway, TenantStore | None]:
    """The gateway with its tenancy: keys from the database (or, with `open_tier`, one unauthenticated user),
    quotas, the fair dispatcher and the overload ladder."""
    store, tiers = None, config.tiers
    if open_tier is not None:  # the single user of an open embedded server: no limits, first in line
        tiers = {**tiers, open_tier: TierConfig(priority=0, weight=1)}
    if config.database_url:
        asyncio.run(migrate(config.database_url))
        store = TenantStore(Database(config.database_url), config.tiers)
    if open_tier is None and store is None:
        raise ValueError("the gateway needs database_url (tenants and API keys); see deploy/fleet.example.yaml")
    if config.overload.free_model:
        raise ValueError("overload.free_model: moving free requests to a smaller model needs model pools, which "
                         "this gateway does not have yet (one model per gateway); leave it unset")
    quota = quota_service(config)
    slots = config.dispatch.slots_per_replica * len(upstreams)
    provisioned = asyncio.run(provisioned_shares(config.database_url)) if store else {}
    dispatcher = Dispatcher(tiers, slots, config.dispatch.quantum_tokens, provisioned=provisioned)
    admission = Admission(quota, dispatcher, OverloadLadder(config.overload))
    auth = Authenticator(None if open_tier else store, tiers, open_tier or "paid")
    secret = config.resume_secret.encode() if config.resume_secret else None
    gateway = Gateway(model, upstreams, buffer or resume_buffer(config), admission, auth, config.streams,
                      load_hook(config.safety_hook), secret)
    d = config.dispatch
    gateway.services.append(lambda: watch_load(admission, upstreams, d.load_interval_s, d.prefill_tokens_per_s))
    gateway.closers.append(quota.close)
    if store is not None:
        gateway.closers.append(store.db.close)
    return gateway, store


async def provisioned_shares(database_url: str) -> dict[str, float]:
    """Organisations with a guaranteed share of the pool's token throughput (read at start)."""
    async with Database(database_url) as db:
        orgs = await TenantStore(db).list_orgs()
    return {org.id: org.provisioned_share for org in orgs if org.provisioned_share}


def admin_routes(gateway: Gateway, store: TenantStore | None, admin_key: str | None, tiers):
    def install(app: FastAPI) -> None:
        if store is not None:
            add_admin_routes(app, store, admin_key, tiers, on_revoke=gateway.auth.forget_key)
    return install


def serve_gateway(args: argparse.Namespace) -> None:
    configure_logging()
    config = FleetConfig.load(args.config)
    if not (config.model_name and config.model_path and config.replicas):
        raise SystemExit(f"{args.config}: model_name, model_path and replicas are required for a gateway")
    upstreams = [HttpUpstream(url) for url in config.replicas]
    gateway, store = build_gateway(config, model_info(config.model_name, config.model_path), upstreams)
    log.info("gateway for %s over %d replica(s) on http://%s:%d", config.model_name, len(upstreams),
             config.host, config.port)
    app = create_gateway_app(gateway, admin_routes(gateway, store, config.admin_key, config.tiers))
    run_http(app, config.host, config.port, config.drain_timeout_s)


def serve_embedded(args: argparse.Namespace) -> None:
    """Gateway and one replica in this process: in-memory resume buffer and quotas, SQLite for keys when --auth,
    the same endpoints as a fleet."""
    configure_logging()
    if args.model is None:
        args.model = str(demo_checkpoint())
    engine_config: EngineConfig = engine_config_from_args(args)
    name = args.served_model_name or Path(engine_config.model).resolve().name
    engine = AsyncEngine(engine_config)
    service = ReplicaService(engine, name)
    info = ModelInfo(name, engine.tokenizer, engine.engine.max_model_len)
    config = embedded_config(args, name, engine_config.model)
    gateway, store = build_gateway(config, info, [InProcessUpstream(service)], None if args.auth else "local",
                                   MemoryResumeBuffer())
    gateway.extra_metrics = service.metrics.render
    install_admin = admin_routes(gateway, store, config.admin_key, config.tiers)

    def replica_routes(app: FastAPI) -> None:
        app.get("/load")(lambda: load_report(engine.engine))
        install_admin(app)

    if args.auth:
        log.info("serving %s on http://%s:%d; API keys from %s (create one with `tokenfleet keys create`)", name,
                 args.host, args.port, config.database_url)
    else:
        log.warning("serving %s on http://%s:%d with NO authentication and no limits (single-user embedded mode; "
                    "--auth requires API keys)", name, args.host, args.port)
    try:
        run_http(create_gateway_app(gateway, replica_routes), args.host, args.port, args.drain_timeout)
    finally:
        engine.shutdown()


def embedded_config(args: argparse.Namespace, name: str, model_path: str) -> FleetConfig:
    """`tokenfleet serve`: the fleet file's tenancy sections when --config is given, its model from the flags."""
    config = FleetConfig.load(args.config) if args.config else FleetConfig()
    config.model_name, config.model_path, config.host, config.port = name, model_path, args.host, args.port
    config.database_url = resolve_database_url(args.database_url, args.config) if args.auth else None
    config.admin_key = config.admin_key or os.environ.get("TOKENFLEET_ADMIN_KEY")
    config.safety_hook = args.safety_hook or config.safety_hook
    config.redis_url = None  # embedded: resume buffer and quotas in memory
    if args.ping_interval is not None:
        config.streams.ping_interval_s = args.ping_interval
    if args.disconnect_grace is not None:
        config.streams.disconnect_grace_s = args.disconnect_grace
    return config


def demo_checkpoint() -> Path:
    if not (DEMO_DIR / "config.json").is_file():
        from tokenfleet.model.demo import write_demo_checkpoint

        log.info("no --model given: writing the demo checkpoint to %s", DEMO_DIR)
        write_demo_checkpoint(DEMO_DIR, size="small")
    return DEMO_DIR
