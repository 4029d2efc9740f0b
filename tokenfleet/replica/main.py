"""`tokenfleet replica`: load the model, start the engine thread, serve HTTP with uvicorn (uvloop)."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tokenfleet.api.http import configure_logging, run_http
from tokenfleet.config import engine_config_from_args
from tokenfleet.engine.async_engine import AsyncEngine
from tokenfleet.replica.server import create_app

log = logging.getLogger(__name__)


def serve_replica(args: argparse.Namespace) -> None:
    configure_logging()
    config = engine_config_from_args(args)
    name = args.served_model_name or Path(config.model).resolve().name
    engine = AsyncEngine(config)
    app = create_app(engine, name)
    log.info("replica serving %s on http://%s:%d", name, args.host, args.port)
    try:
        run_http(app, args.host, args.port, args.drain_timeout)
    finally:
        engine.shutdown()
