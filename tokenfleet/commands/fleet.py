"""`tokenfleet fleet --replicas N`: a whole local fleet in one command. It writes the demo checkpoint when no
--model is given, creates and migrates the database when missing, checks Redis, starts N `tokenfleet replica`
processes and, once they answer, a `tokenfleet gateway` in front of them; then prints where everything is and an
admin key, and stops it all (gateway first, so it drains) on Ctrl-C or SIGTERM, or when one of them dies."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
import yaml
from sqlalchemy.exc import SQLAlchemyError

from tokenfleet.commands.database import DATA_HOME, describe, init_database
from tokenfleet.commands.errors import CommandError
from tokenfleet.commands.preflight import check_redis
from tokenfleet.store.db import ENV_VAR, async_url

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/tokenfleet"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
START_TIMEOUT_S = 600.0  # a first start compiles the CPU kernel and may load a large checkpoint
STOP_TIMEOUT_S = 45.0  # the gateway drains in-flight streams first (drain_timeout_s 30 s)


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2, help="number of replicas (default: 2)")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the demo checkpoint, written once)")
    parser.add_argument(
        "--served-model-name", default=None, help="model name clients use (default: the checkpoint folder's name)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address every process listens on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="the gateway's port (default: 8000)")
    parser.add_argument(
        "--replica-port", type=int, default=8100, help="the first replica's port; the others follow (default: 8100)"
    )
    parser.add_argument(
        "--database-url",
        default=None,
        help=f"PostgreSQL database, created when missing (default: ${ENV_VAR}, else {DEFAULT_DATABASE_URL})",
    )
    parser.add_argument(
        "--redis-url", default=None, help=f"Redis (default: $TOKENFLEET_REDIS_URL, else {DEFAULT_REDIS_URL})"
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help=f"where the fleet file goes (default: {DATA_HOME / 'fleet'})",
    )
    parser.add_argument(
        "replica_args",
        nargs=argparse.REMAINDER,
        help="after --: flags for every replica, e.g. -- --max-model-len 1024 (see tokenfleet replica --help)",
    )


@dataclass(frozen=True)
class FleetPlan:
    model: str
    model_name: str
    host: str
    port: int
    replica_ports: list[int]
    database_url: str
    redis_url: str
    data_dir: Path
    admin_key: str
    replica_args: list[str]

    @property
    def local_host(self) -> str:
        """Where this machine reaches a process listening on `host`."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host

    def url(self, port: int) -> str:
        return f"http://{self.local_host}:{port}"

    @property
    def replica_urls(self) -> list[str]:
        return [self.url(port) for port in self.replica_ports]

    @property
    def config_path(self) -> Path:
        return self.data_dir / "fleet.yaml"


def run_fleet_command(args: argparse.Namespace) -> int:
    plan = plan_fleet(args)
    prepare(plan)
    stop = StopSignal()
    fleet = Fleet(plan)
    try:
        fleet.start(stop)
        if stop.is_set():
            return 0
        print_summary(plan)
        failed = fleet.watch(stop)
    finally:
        fleet.stop()
    print(f"tokenfleet fleet: {failed or 'stopped'}", flush=True)
    return 1 if failed else 0


def plan_fleet(args: argparse.Namespace) -> FleetPlan:
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.model is None:
        from tokenfleet.commands.demo import demo_checkpoint

        args.model = str(demo_checkpoint())
    model = str(Path(args.model).expanduser().resolve())
    if not Path(model, "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint at {args.model} (a folder with config.json and *.safetensors)")
    database_url = args.database_url or os.environ.get(ENV_VAR) or DEFAULT_DATABASE_URL
    if async_url(database_url).get_backend_name() != "postgresql":
        raise ValueError(f"a fleet keeps its tenants and usage in PostgreSQL, not {describe(database_url)}")
    extra = args.replica_args[1:] if args.replica_args[:1] == ["--"] else args.replica_args
    return FleetPlan(
        model=model,
        model_name=args.served_model_name or Path(model).name,
        host=args.host,
        port=args.port,
        replica_ports=[args.replica_port + i for i in range(args.replicas)],
        database_url=database_url,
        redis_url=args.redis_url or os.environ.get("TOKENFLEET_REDIS_URL") or DEFAULT_REDIS_URL,
        data_dir=Path(args.data_dir).expanduser() if args.data_dir else DATA_HOME.expanduser() / "fleet",
        admin_key=os.environ.get("TOKENFLEET_ADMIN_KEY") or "tf-admin-" + secrets.token_urlsafe(24),
        replica_args=list(extra),
    )


def prepare(plan: FleetPlan) -> None:
    """Everything that can fail before a process starts: ports, the database (created when missing), Redis, the
    fleet file."""
    for port in (plan.port, *plan.replica_ports):
        if not port_is_free(plan.host, port):
            raise CommandError(f"port {port} on {plan.host} is in use: choose --port / --replica-port")
    try:
        created = asyncio.run(init_database(plan.database_url))
    except (OSError, SQLAlchemyError) as e:
        raise CommandError(f"cannot migrate {describe(plan.database_url)}: {e}") from None
    say(f"database {describe(plan.database_url)}: {'created and migrated' if created else 'migrated'}")
    asyncio.run(check_redis(plan.redis_url, "give --redis-url"))
    plan.data_dir.mkdir(parents=True, exist_ok=True)
    plan.config_path.write_text(yaml.safe_dump(fleet_file(plan), sort_keys=False))


def fleet_file(plan: FleetPlan) -> dict:
    """The gateway's fleet.yaml. The Redis keys are named after the database, so two local fleets (on two
    databases) sharing one Redis never read each other's streams, quotas or usage events."""
    namespace = f"tokenfleet:{async_url(plan.database_url).database}:"
    return {
        "model_name": plan.model_name,
        "model_path": plan.model,
        "replicas": plan.replica_urls,
        "host": plan.host,
        "port": plan.port,
        "database_url": plan.database_url,
        "redis_url": plan.redis_url,
        "redis_prefix": namespace + "stream:",
        "quota": {"prefix": namespace + "quota:"},
        "metering": {"stream_key": namespace + "usage"},
        "routing": {"register_prefix": namespace + "replicas:"},
    }


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def print_summary(plan: FleetPlan) -> None:
    gateway = plan.url(plan.port)
    lines = [
        f"fleet ready: {len(plan.replica_ports)} replica(s) of {plan.model_name} behind the gateway",
        f"  OpenAI API   {gateway}/v1  (model {plan.model_name!r})",
        f"  replicas     {', '.join(plan.replica_urls)}",
        f"  admin key    {plan.admin_key}  (Authorization: Bearer, for {gateway}/admin/v1)",
        f"  database     {describe(plan.database_url)}",
        f"  fleet file   {plan.config_path}",
        f"  API key      tokenfleet keys create --config {shlex.quote(str(plan.config_path))} --org ORG --user USER",
        "Ctrl-C stops the fleet.",
    ]
    say("\n".join(lines))


def say(text: str) -> None:
    print(text, flush=True)


# --- processes ---------------------------------------------------------------------------------------------------


class StopSignal(threading.Event):
    """Set by SIGINT (Ctrl-C) or SIGTERM. The children run in sessions of their own, so a Ctrl-C at the terminal
    reaches only this process, which then stops them in order."""

    def __init__(self) -> None:
        super().__init__()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: self.set())


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    health_url: str
    relay: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.relay = threading.Thread(target=relay_output, args=(self.name, self.process.stdout), daemon=True)
        self.relay.start()


class Fleet:
    def __init__(self, plan: FleetPlan) -> None:
        self.plan = plan
        self.replicas: list[Child] = []
        self.gateway: Child | None = None

    def start(self, stop: threading.Event) -> None:
        """Replicas first; the gateway once they all answer (it reads no load report from a replica still
        loading)."""
        threads = max(1, ((os.cpu_count() or 2) - 1) // len(self.plan.replica_ports))
        for index, port in enumerate(self.plan.replica_ports):
            args = ["replica", "--model", self.plan.model, "--host", self.plan.host, "--port", str(port)]
            args += ["--served-model-name", self.plan.model_name]
            if "--threads" not in self.plan.replica_args:
                args += ["--threads", str(threads)]
            self.replicas.append(self.spawn(f"replica-{index}", args + self.plan.replica_args, self.plan.url(port)))
        say(f"starting {len(self.replicas)} replica(s) of {self.plan.model_name}")
        if not wait_healthy(self.replicas, stop):
            return
        gateway_env = {"TOKENFLEET_ADMIN_KEY": self.plan.admin_key}
        args = ["gateway", "--config", str(self.plan.config_path)]
        self.gateway = self.spawn("gateway", args, self.plan.url(self.plan.port), gateway_env)
        wait_healthy([self.gateway], stop)

    def spawn(self, name: str, args: list[str], base_url: str, env: dict[str, str] | None = None) -> Child:
        process = subprocess.Popen(
            [sys.executable, "-m", "tokenfleet", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        return Child(name, process, f"{base_url}/health")

    @property
    def children(self) -> list[Child]:
        return [*self.replicas, *([self.gateway] if self.gateway else [])]

    def watch(self, stop: threading.Event) -> str | None:
        """Until a stop signal (None) or a child's death (what died)."""
        while not stop.wait(0.5):
            for child in self.children:
                if child.process.poll() is not None:
                    return f"{child.name} exited with code {child.process.returncode}; stopping the fleet"
        return None

    def stop(self) -> None:
        """SIGTERM to the gateway first (it drains), then to the replicas; SIGKILL to what outlives the wait."""
        for group in ([self.gateway] if self.gateway else [], self.replicas):
            for child in group:
                if child.process.poll() is None:
                    child.process.terminate()
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for child in group:
                try:
                    child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.process.kill()
                    child.process.wait()
                child.relay.join(timeout=2)


def wait_healthy(children: list[Child], stop: threading.Event) -> bool:
    """Until every child's /health answers 200 (True), or a stop signal (False); a child that dies first is a
    CommandError."""
    pending = list(children)
    deadline = time.monotonic() + START_TIMEOUT_S
    with httpx.Client(timeout=1.0) as client:
        while pending:
            for child in list(pending):
                if child.process.poll() is not None:
                    raise CommandError(f"{child.name} exited with code {child.process.returncode} while starting")
                try:
                    if client.get(child.health_url).status_code == 200:
                        pending.remove(child)
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise CommandError(f"{', '.join(c.name for c in pending)} not up after {START_TIMEOUT_S:.0f} s")
            if pending and stop.wait(0.25):
                return False
    return True


def relay_output(name: str, stream: IO[bytes]) -> None:
    """A child's output, line by line, each line under its name."""
    for raw in iter(stream.readline, b""):
        sys.stdout.write(f"{name:<10}| {raw.decode(errors='replace')}")
        sys.stdout.flush()
    stream.close()


def die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the fleet process dies, even by SIGKILL, so no replica outlives
    it holding memory and ports."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
