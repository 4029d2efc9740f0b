"""`tokenfleet serve` (gateway + in-process replica, one process) and `tokenfleet gateway --config fleet.yaml`."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from fastapi import FastAPI

from tokenfleet.api.http import configure_logging, run_http
from tokenfleet.config import EngineConfig, FleetConfig, StreamSettings, engine_config_from_args
from tokenfleet.engine.async_engine import AsyncEngine
from tokenfleet.gateway.app import Gateway, ModelInfo, create_gateway_app
from tokenfleet.gateway.resume import MemoryResumeBuffer, RedisResumeBuffer
from tokenfleet.gateway.safety import load_hook
from tokenfleet.gateway.upstream import HttpUpstream, InProcessUpstream
from tokenfleet.model.config import ModelConfig
from tokenfleet.model.tokenizer import Tokenizer
from tokenfleet.replica.metrics import load_report
from tokenfleet.replica.server import ReplicaService

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


def serve_gateway(args: argparse.Namespace) -> None:
    configure_logging()
    config = FleetConfig.load(args.config)
    upstreams = [HttpUpstream(url) for url in config.replicas]
    gateway = Gateway(model_info(config.model_name, config.model_path), upstreams, resume_buffer(config),
                      config.streams, load_hook(config.safety_hook))
    log.info("gateway for %s over %d replica(s) on http://%s:%d", config.model_name, len(upstreams),
             config.host, config.port)
    run_http(create_gateway_app(gateway), config.host, config.port, config.drain_timeout_s)


def serve_embedded(args: argparse.Namespace) -> None:
    """Gateway and one replica in this process: in-memory resume buffer, the same endpoints as a fleet."""
    configure_logging()
    if args.model is None:
        args.model = str(demo_checkpoint())
    engine_config: EngineConfig = engine_config_from_args(args)
    name = args.served_model_name or Path(engine_config.model).resolve().name
    engine = AsyncEngine(engine_config)
    service = ReplicaService(engine, name)
    info = ModelInfo(name, engine.tokenizer, engine.engine.max_model_len)
    settings = StreamSettings(ping_interval_s=args.ping_interval, disconnect_grace_s=args.disconnect_grace)
    gateway = Gateway(info, [InProcessUpstream(service)], MemoryResumeBuffer(), settings,
                      load_hook(args.safety_hook))

    gateway.extra_metrics = service.metrics.render

    def replica_routes(app: FastAPI) -> None:
        app.get("/load")(lambda: load_report(engine.engine))

    log.warning("serving %s on http://%s:%d with NO authentication (single-user embedded mode)", name, args.host,
                args.port)
    try:
        run_http(create_gateway_app(gateway, replica_routes), args.host, args.port, args.drain_timeout)
    finally:
        engine.shutdown()


def demo_checkpoint() -> Path:
    if not (DEMO_DIR / "config.json").is_file():
        from tokenfleet.model.demo import write_demo_checkpoint

        log.info("no --model given: writing the demo checkpoint to %s", DEMO_DIR)
        write_demo_checkpoint(DEMO_DIR, size="small")
    return DEMO_DIR
