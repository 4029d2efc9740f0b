"""`tokenfleet serve` (gateway + in-process replica, one process) and `tokenfleet gateway --config fleet.yaml`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
from fastapi import FastAPI

from tokenfleet.api.http import run_http
from tokenfleet.autoscale.service import add_autoscaler
from tokenfleet.billing.routes import add_usage_routes
from tokenfleet.commands.database import default_data_dir, describe, resolve_database_url
from tokenfleet.commands.demo import DEMO_DIR, demo_checkpoint
from tokenfleet.commands.preflight import check_fleet_services
from tokenfleet.commands.workers import check_workers, run_workers
from tokenfleet.config import FleetConfig, TierConfig
from tokenfleet.conversations.routes import add_conversation_routes
from tokenfleet.dispatch.overload import OverloadLadder
from tokenfleet.dispatch.queue import Dispatcher
from tokenfleet.engine.config import EngineConfig, engine_config_from_args
from tokenfleet.gateway.admin import add_admin_routes
from tokenfleet.gateway.admission import Admission, watch_load
from tokenfleet.gateway.app import Gateway, ModelInfo, create_gateway_app
from tokenfleet.gateway.auth import Authenticator
from tokenfleet.gateway.fleet_buffer import FleetResumeBuffer, redis_client
from tokenfleet.gateway.resume import MemoryResumeBuffer, RedisResumeBuffer, ResumeBuffer
from tokenfleet.gateway.safety import load_hook
from tokenfleet.gateway.upstream import HttpUpstream, InProcessUpstream
from tokenfleet.gateway.usage import reconciler
from tokenfleet.logs import configure_logging
from tokenfleet.metering import MemoryLog, Outbox, OutboxShipper, RedisStreamLog, WarehouseWriter
from tokenfleet.metering.recorder import UsageRecorder
from tokenfleet.model.config import ModelConfig
from tokenfleet.model.tokenizer import Tokenizer
from tokenfleet.quota.base import QuotaService
from tokenfleet.quota.failover import FailoverQuota
from tokenfleet.quota.leases import LeasedQuota
from tokenfleet.quota.memory import MemoryQuota
from tokenfleet.quota.redis import RedisQuota
from tokenfleet.responses.routes import add_response_routes
from tokenfleet.router.catalog import ModelCatalog
from tokenfleet.router.registry import ReplicaRegistry
from tokenfleet.router.router import Router
from tokenfleet.store.db import Database
from tokenfleet.store.tenants import TenantStore
from tokenfleet.tracing import configure_tracing

log = logging.getLogger(__name__)


def model_info(name: str, path: str, max_model_len: int | None = None) -> ModelInfo:
    config = ModelConfig.from_dir(path)
    window = config.max_model_len
    return ModelInfo(name, Tokenizer.from_dir(path), min(max_model_len or window, window), config.vocab_size)


def resume_buffer(config: FleetConfig):
    if not config.redis_url:
        return MemoryResumeBuffer(config.resume_ttl_s)
    shared = RedisResumeBuffer(
        redis_client(config.redis_url),
        config.redis_prefix,
        config.resume_ttl_s,
        owner_lease_s=config.streams.owner_lease_s,
    )
    return FleetResumeBuffer(shared)


def quota_service(config: FleetConfig) -> QuotaService:
    """Redis in a fleet (each tier falling back as its on_quota_outage says), in memory embedded."""
    settings = config.quota
    backend = settings.backend if settings.backend != "auto" else ("redis" if config.redis_url else "memory")
    if backend == "memory":
        return MemoryQuota()
    if not config.redis_url:
        raise ValueError("quota.backend is redis but the fleet file has no redis_url")
    redis_quota = RedisQuota.from_url(
        config.redis_url,
        settings.prefix,
        connect_timeout_s=settings.timeout_s,
        socket_timeout_s=settings.timeout_s,
        hot_tenants=settings.hot_tenants,
        slice_index=settings.slice_index,
        rebalance_interval_s=settings.rebalance_interval_s,
    )
    policy = {name: tier.on_quota_outage for name, tier in config.tiers.items()}
    shared: QuotaService = LeasedQuota(redis_quota) if settings.local_leases else redis_quota
    return FailoverQuota(shared, MemoryQuota(), policy, breaker_s=settings.retry_after_outage_s)


def build_gateway(
    config: FleetConfig,
    models: dict[str, ModelInfo],
    make_upstream,
    open_tier: str | None = None,
    buffer: ResumeBuffer | None = None,
) -> tuple[Gateway, TenantStore | None]:
    """The gateway: tenancy (keys from the database, or with `open_tier` one unauthenticated user), quotas, one
    fair dispatcher per model, the overload ladder, and the router over the configured (and registered) replicas.
    `make_upstream(url, name, kind)` is how the router reaches a replica."""
    tiers = config.tiers
    if open_tier is not None and open_tier not in tiers:  # an open server's single user: no limits, first in line
        tiers = {**tiers, open_tier: TierConfig(priority=0, weight=1)}
    if open_tier is None and not config.database_url:
        raise ValueError("the gateway needs database_url (tenants, API keys, usage); see deploy/fleet.example.yaml")
    db, store, provisioned = None, None, {}  # no database: an open gateway without metering (a library use)
    if config.database_url:
        provisioned = asyncio.run(prepare_tenants(config.database_url))
        db = Database(config.database_url)
        store = TenantStore(db, config.tiers)
    router = Router(
        ModelCatalog(config.served_models(), config.routing.rules),
        config.routing,
        config.dispatch.replica_slots,
        make_upstream,
    )
    router.add_configured_replicas()
    check_disaggregated_pools(router)
    free_model = config.overload.free_model
    if free_model and router.catalog.lookup(free_model) is None:
        raise ValueError(f"overload.free_model {free_model!r} is not a configured model")
    quota = quota_service(config)
    dispatchers = {
        name: Dispatcher(
            tiers,
            config.dispatch.replica_slots * max(1, len(pools.replicas)),
            config.dispatch.quantum_tokens,
            provisioned=provisioned,
        )
        for name, pools in router.models.items()
    }
    ask_ahead = config.quota.ask_replica_ahead and not isinstance(quota, MemoryQuota)  # memory answers at once
    admission = Admission(quota, dispatchers, OverloadLadder(config.overload), ask_ahead)
    auth = Authenticator(None if open_tier else store, tiers, open_tier or "paid")
    secret = config.resume_secret.encode() if config.resume_secret else None
    buffer = buffer or resume_buffer(config)
    gateway = Gateway(
        models,
        router,
        buffer,
        admission,
        auth,
        config.streams,
        load_hook(config.safety_hook),
        secret,
        usage=None if db is None else usage_recorder(config, db, buffer),
        db=db,
    )
    add_background_work(gateway, config)
    if isinstance(gateway.buffer, FleetResumeBuffer):
        gateway.services.append(gateway.buffer.keep_alive)
    gateway.closers.append(quota.close)
    if db is not None:
        add_metering(gateway, config, db)
        gateway.closers.append(db.close)
    return gateway, store


def check_disaggregated_pools(router: Router) -> None:
    """A model's prefill and decode replicas must share one KV layout (checkpoint, block size, KV dtype), or no block
    could move between them: checked at start for the configured ones that answer (a replica joining later, or one
    not up yet, is checked at its first transfer, which it refuses with the same reason)."""
    for model, pools in router.models.items():
        split = [r for r in pools.replicas.values() if r.role != "both"]
        if {r.role for r in split} != {"prefill", "decode"}:
            continue
        layouts: dict[str, str] = {}
        for replica in split:
            try:
                info = httpx.get(f"{replica.url}/internal/kv/info", timeout=2.0).json()
                layouts[f"{replica.role} {replica.name}"] = json.dumps(info["layout"], sort_keys=True)
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                log.warning("cannot check the KV layout of %s (%s) now: %s", replica.name, replica.role, e)
        if len(set(layouts.values())) > 1:
            described = "; ".join(f"{name}: {layout}" for name, layout in layouts.items())
            raise ValueError(f"model {model}: its prefill and decode replicas' KV layouts differ ({described})")


def usage_recorder(config: FleetConfig, db: Database, buffer: ResumeBuffer) -> UsageRecorder:
    """A usage event per request: the recorder keeps each request's outbox row."""
    settings = config.metering
    # a dead gateway's requests are billed for what their resume streams show was generated (fleet)
    reconcile = reconciler(buffer) if isinstance(buffer, FleetResumeBuffer) else None
    return UsageRecorder(
        Outbox(db), settings.lease_s, settings.checkpoint_s, settings.batch_s, reconcile, settings.close_batch_s
    )


def add_metering(gateway: Gateway, config: FleetConfig, db: Database) -> None:
    """The recorder's loop; the shipper moves closed outbox rows to the event log (the Redis Stream in a fleet, in
    memory embedded); the writer fills the warehouse table."""
    settings, outbox, recorder = config.metering, Outbox(db), gateway.usage
    assert recorder is not None
    if config.redis_url:
        event_log = RedisStreamLog.from_url(config.redis_url, settings.stream_key, settings.group)
    else:
        event_log = MemoryLog()
    shipper = OutboxShipper(
        outbox,
        event_log,
        settings.ship_interval_s,
        keep_sent_s=settings.keep_sent_s,
        reship_after_s=settings.reship_after_s,
    )

    async def ship() -> None:
        if isinstance(event_log, MemoryLog):  # what the last run's in-memory log held died with it
            await resend_unwritten(outbox)
        await shipper.run()

    gateway.services += [recorder.run, ship]
    if settings.write_warehouse:
        writer = WarehouseWriter(db, event_log, settings.consumer or socket.gethostname())
        gateway.services.append(writer.run)
    gateway.closers += [recorder.flush, recorder.outbox.aclose, event_log.close]


async def resend_unwritten(outbox: Outbox) -> None:
    try:
        resent = await outbox.resend_unwritten()
    except Exception:  # the database is down: the reaper and the next start try again
        log.exception("usage outbox: could not look for events the warehouse never got")
        return
    if resent:
        log.info("usage outbox: %d event(s) shipped before the last stop were never written; resending", resent)


def add_background_work(gateway: Gateway, config: FleetConfig) -> None:
    """Load reports, active health checks, the overload ladder, and (in a fleet) the Redis replica registry."""
    router, d = gateway.router, config.dispatch
    gateway.services.append(router.refresh_loads)
    gateway.services.append(
        lambda: watch_load(gateway.admission, router, d.load_interval_s, d.replica_slots, d.prefill_tokens_per_s)
    )

    async def health_checks() -> None:
        async with httpx.AsyncClient() as client:
            await router.health.run_active_checks(client)

    gateway.services.append(health_checks)
    if config.redis_url:
        import redis.asyncio as redis

        registry = ReplicaRegistry(redis.from_url(config.redis_url), config.routing.register_prefix)
        gateway.services.append(lambda: registry.watch(router.on_registry_change))


def load_models(config: FleetConfig) -> dict[str, ModelInfo]:
    """Every served model's tokenizer and context window, read from its checkpoint folder."""
    infos = {}
    for spec in config.served_models():
        if not Path(spec.path, "config.json").is_file():
            raise ValueError(
                f"model {spec.name}: no checkpoint at {spec.path!r} (the gateway reads its tokenizer "
                "and context window from there)"
            )
        infos[spec.name] = model_info(spec.name, spec.path, spec.max_model_len)
    return infos


async def prepare_tenants(database_url: str) -> dict[str, float]:
    """Before serving, in one connection: migrate the tenants database, then read the organisations with a
    guaranteed share of the pool's token throughput (read at start only)."""
    async with Database(database_url) as db:
        await db.migrate()
        orgs = await TenantStore(db).list_orgs()
    return {org.id: org.provisioned_share for org in orgs if org.provisioned_share}


def admin_routes(gateway: Gateway, store: TenantStore | None, config: FleetConfig):
    """The routes over the database: tenants and keys (admin), usage and costs."""

    def install(app: FastAPI) -> None:
        if store is not None:
            add_admin_routes(app, store, config.admin_key, config.tiers, on_revoke=gateway.auth.forget_key)
        if gateway.db is not None:
            add_usage_routes(app, gateway, gateway.db, config.billing, config.admin_key)
            add_conversation_routes(app, gateway, gateway.db, config.conversations)
            add_response_routes(app, gateway, gateway.db)

    return install


def serve_gateway(args: argparse.Namespace) -> None:
    workers, worker = getattr(args, "workers", 1), getattr(args, "worker_index", None)
    configure_logging(None if worker is None else f"worker {worker}")
    config = FleetConfig.load(args.config)
    config.host = args.host or config.host
    config.port = args.port or config.port
    if not config.served_models():
        raise SystemExit(f"{args.config}: no model to serve: give models (or model_name and model_path)")
    check_workers(config, workers)
    if worker is None:
        check_fleet_services(config.database_url, config.redis_url, args.config)  # one clear line, not a traceback
    if workers > 1:
        if config.database_url:  # migrated once, here, rather than by every worker at the same moment
            asyncio.run(prepare_tenants(config.database_url))
        log.info("gateway: %d worker processes on http://%s:%d", workers, config.host, config.port)
        run_workers(args, workers, serve_gateway)
        return
    configure_tracing("tokenfleet-gateway")  # when OTEL_EXPORTER_OTLP_ENDPOINT names a collector
    timeout = config.routing.replica_timeout_s

    def upstream(url: str, name: str, kind: str) -> HttpUpstream:
        return HttpUpstream(url, name, kind, read_timeout_s=timeout)

    gateway, store = build_gateway(config, load_models(config), upstream)
    add_autoscaler(gateway, config)  # when autoscale.enabled
    for name, pools in gateway.router.models.items():
        log.info("serving %s over %d configured replica(s)", name, len(pools.replicas))
    log.info("gateway on http://%s:%d", config.host, config.port)
    app = create_gateway_app(gateway, admin_routes(gateway, store, config), config.admin_key)
    run_http(app, config.host, config.port, config.drain_timeout_s, reuse_port=worker is not None)


def serve_embedded(args: argparse.Namespace) -> None:
    """Gateway and one replica in this process: in-memory resume buffer and quotas, SQLite for keys when --auth,
    the same endpoints as a fleet."""
    from tokenfleet.engine.engine_process import start_engine  # the engine (and PyTorch) only where it runs
    from tokenfleet.replica.server import ReplicaService

    configure_logging()
    configure_tracing("tokenfleet")  # when OTEL_EXPORTER_OTLP_ENDPOINT names a collector
    if args.model is None:
        args.model = str(demo_checkpoint_in_a_child())
    engine_config: EngineConfig = engine_config_from_args(args)
    name = args.served_model_name or Path(engine_config.model).resolve().name
    engine = start_engine(engine_config)
    service = ReplicaService(engine, name)
    vocab_size = ModelConfig.from_dir(engine_config.model).vocab_size
    info = ModelInfo(name, engine.tokenizer, engine.max_model_len, vocab_size)
    config = embedded_config(args, name, engine_config.model)
    if config.dispatch.slots_per_replica is None:  # its one replica's engine runs this many at once
        config.dispatch.slots_per_replica = engine_config.max_num_seqs
    local = InProcessUpstream(service)
    gateway, store = build_gateway(
        config,
        {name: info},
        lambda url, replica, kind: local,
        None if args.auth else "local",
        MemoryResumeBuffer(config.resume_ttl_s),
    )
    gateway.router.models[name].add("local", "", "local", "tokenfleet", lambda url, replica: local)
    gateway.extra_metrics = service.metrics.render
    install_admin = admin_routes(gateway, store, config)

    def replica_routes(app: FastAPI) -> None:
        app.get("/load")(lambda: engine.state().load)
        install_admin(app)

    if args.auth:
        log.info(
            "serving %s on http://%s:%d; API keys from %s (create one with `tokenfleet keys create`)",
            name,
            args.host,
            args.port,
            config.database_url,
        )
    else:
        log.warning(
            "serving %s on http://%s:%d with NO authentication and no limits (single-user embedded mode; "
            "--auth requires API keys)",
            name,
            args.host,
            args.port,
        )
    try:
        run_http(
            create_gateway_app(gateway, replica_routes, config.admin_key), args.host, args.port, args.drain_timeout
        )
    finally:
        engine.shutdown()


WRITE_DEMO = """
from tokenfleet.commands.demo import demo_checkpoint
from tokenfleet.logs import configure_logging
configure_logging()
demo_checkpoint()
"""


def demo_checkpoint_in_a_child() -> Path:
    """The demo checkpoint, written by a child process when missing: writing it takes PyTorch, which this server
    process otherwise never loads (it would hold 150-250 MB more for its whole life)."""
    if not (DEMO_DIR / "config.json").is_file():
        if subprocess.run([sys.executable, "-c", WRITE_DEMO]).returncode != 0:
            raise SystemExit("tokenfleet serve: writing the demo checkpoint failed (see above); or give --model DIR")
    return demo_checkpoint()


def embedded_config(args: argparse.Namespace, name: str, model_path: str) -> FleetConfig:
    """`tokenfleet serve`: the fleet file's tenancy sections when --config is given, its model from the flags."""
    config = FleetConfig.load(args.config) if args.config else FleetConfig()
    config.model_name, config.model_path, config.host, config.port = name, model_path, args.host, args.port
    config.models = []  # embedded: the one model of the flags
    data_dir = Path(args.data_dir).expanduser() if args.data_dir else default_data_dir(args.port)
    data_dir.mkdir(parents=True, exist_ok=True)
    # usage (and keys with --auth)
    config.database_url = resolve_database_url(args.database_url, args.config, args.data_dir, data_dir)
    log.info("data dir: %s (--data-dir to choose); database: %s", data_dir, describe(config.database_url))
    config.admin_key = config.admin_key or os.environ.get("TOKENFLEET_ADMIN_KEY")
    config.safety_hook = args.safety_hook or config.safety_hook
    config.redis_url = None  # embedded: resume buffer and quotas in memory
    if args.ping_interval is not None:
        config.streams.ping_interval_s = args.ping_interval
    if args.disconnect_grace is not None:
        config.streams.disconnect_grace_s = args.disconnect_grace
    return config
