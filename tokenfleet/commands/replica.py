"""`tokenfleet replica`: load the model, start the engine thread, serve HTTP with uvicorn (uvloop).

With `--register REDIS_URL` the replica also joins the fleet's registry (tokenfleet.router.registry): it announces
itself once its engine is loaded and its HTTP server answers, heartbeats while it serves, is marked draining the
moment SIGTERM (or SIGINT) arrives, and withdraws when the drain is over."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import redis.asyncio as aioredis
from fastapi import FastAPI

from tokenfleet.api.http import run_http, within_lifespan
from tokenfleet.engine.config import engine_config_from_args
from tokenfleet.engine.engine_process import start_engine
from tokenfleet.logs import configure_logging
from tokenfleet.replica.disagg import KVRole, check_role
from tokenfleet.replica.server import create_app
from tokenfleet.router.registry import RegistryKeys, ReplicaAnnouncer, ReplicaRecord
from tokenfleet.tracing import configure_tracing

log = logging.getLogger(__name__)

_ANY_ADDRESS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def serve_replica(args: argparse.Namespace) -> None:
    configure_logging()
    configure_tracing("tokenfleet-replica")  # when OTEL_EXPORTER_OTLP_ENDPOINT names a collector
    config = engine_config_from_args(args)
    name = args.served_model_name or Path(config.model).resolve().name
    registration = registration_from_args(args, name) if getattr(args, "register", None) else None
    role = kv_role_from_args(args)
    engine = start_engine(config)
    try:
        check_role(role, engine)
    except ValueError:
        engine.shutdown()
        raise
    app = create_app(engine, name, role)
    if registration is not None:
        attach_registration(app, registration)
    log.info("replica serving %s on http://%s:%d (role %s)", name, args.host, args.port, role.role)
    try:
        run_http(app, args.host, args.port, args.drain_timeout)
    finally:
        engine.shutdown()


def kv_role_from_args(args: argparse.Namespace) -> KVRole:
    role = getattr(args, "role", "both")
    advertised = urlsplit(args.advertise_url).hostname if getattr(args, "advertise_url", None) else None
    host = advertised or _ANY_ADDRESS.get(args.host, args.host)
    return KVRole(role, args.host, getattr(args, "kv_port", 0), host)


@dataclass(frozen=True)
class Registration:
    redis_url: str
    record: ReplicaRecord
    prefix: str
    ttl_s: float
    health_url: str  # our own /health, as reachable from this machine: announce only once it answers

    @property
    def heartbeat_s(self) -> float:
        return self.ttl_s / 3


def registration_from_args(args: argparse.Namespace, model_name: str) -> Registration:
    if args.registry_ttl <= 0:
        raise ValueError(f"--registry-ttl must be positive, got {args.registry_ttl}")
    RegistryKeys.under(args.registry_prefix)  # rejects a prefix the registry cannot use, before the model loads
    url = (args.advertise_url or default_advertise_url(args.host, args.port)).rstrip("/")
    record = ReplicaRecord(
        name=urlsplit(url).netloc or url,
        url=url,
        model=model_name,
        pool=args.pool,
        started_at=time.time(),
        role=getattr(args, "role", "both"),
    )
    local = _bracketed(_ANY_ADDRESS.get(args.host, args.host))
    return Registration(
        args.register, record, args.registry_prefix, args.registry_ttl, f"http://{local}:{args.port}/health"
    )


def default_advertise_url(host: str, port: int) -> str:
    """http://HOST:PORT; a wildcard bind address becomes this machine's hostname (127.0.0.1 if it doesn't
    resolve)."""
    if host in _ANY_ADDRESS:
        host = _resolvable_hostname() or "127.0.0.1"
    return f"http://{_bracketed(host)}:{port}"


def _resolvable_hostname() -> str | None:
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
    except OSError:
        return None
    return name


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def attach_registration(app: FastAPI, registration: Registration) -> None:
    """Runs the registration inside the app's lifespan, around whatever lifespan the app already has."""
    within_lifespan(app, lambda: registered(registration))


@contextlib.asynccontextmanager
async def registered(registration: Registration) -> AsyncIterator[ReplicaAnnouncer]:
    """Lifespan startup: start announcing in the background. Lifespan shutdown (which uvicorn runs only after the
    drain): stop heartbeats and withdraw. The drain itself starts at the signal, see on_exit_signal."""
    timeout = min(2.0, registration.heartbeat_s)
    client = aioredis.from_url(registration.redis_url, socket_connect_timeout=timeout, socket_timeout=timeout)
    announcer = ReplicaAnnouncer(
        client, registration.record, registration.prefix, registration.ttl_s, registration.heartbeat_s
    )
    heartbeats = asyncio.create_task(_announce_when_serving(announcer, registration.health_url))
    drains: set[asyncio.Task] = set()

    def start_drain() -> None:
        task = asyncio.create_task(announcer.set_draining(True))
        drains.add(task)
        task.add_done_callback(drains.discard)
        log.info("replica %s marked draining in the registry", announcer.record.name)

    on_exit_signal(start_drain)
    try:
        yield announcer
    finally:
        heartbeats.cancel()
        await asyncio.gather(heartbeats, *drains, return_exceptions=True)
        await announcer.withdraw()
        await client.aclose()


async def _announce_when_serving(announcer: ReplicaAnnouncer, health_url: str) -> None:
    """The lifespan starts before uvicorn listens: wait until our own /health answers, then heartbeat."""
    async with httpx.AsyncClient(timeout=1.0) as http:
        while True:
            try:
                if (await http.get(health_url)).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
    log.info("replica %s (%s) announced to the registry", announcer.record.name, announcer.record.url)
    await announcer.run()


def on_exit_signal(callback: Callable[[], None]) -> None:
    """Calls `callback` on the running loop as soon as SIGTERM or SIGINT arrives, then lets the existing handler run.

    uvicorn's lifespan shutdown only comes after the drain (in-flight streams finish first), too late to tell
    gateways to stop sending work. uvicorn installs its handlers with signal.signal before the lifespan starts and
    restores the ones it replaced when it exits, which also drops this wrapper."""
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)
        if not callable(previous):
            continue  # not under uvicorn's handlers: leave the default behaviour alone

        def handler(signum: int, frame, previous=previous) -> None:
            loop.call_soon_threadsafe(callback)
            previous(signum, frame)

        signal.signal(sig, handler)
