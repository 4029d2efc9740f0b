"""The platform with tenants, both ways: embedded (`tokenfleet serve --auth`: SQLite, in-memory quotas) and fleet
(gateway + replicas as processes: PostgreSQL, Redis). Each gets tenants and keys through the admin API."""

from __future__ import annotations

import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from tests.servers import delete_redis_keys, free_port, running_process
from tests.store.backends import create_postgres_database, database_url, drop_postgres_database

MODEL = "tiny"
ADMIN_KEY = "test-admin-key"
# free users may run one request at a time: the quota tests lean on that
PRICES = {MODEL: {"input": 1.0, "cached_input": 0.5, "output": 4.0}}  # USD per million tokens
# a test that hangs up and resumes must come back within the grace period, even on a loaded machine
TENANCY = {
    "admin_key": ADMIN_KEY,
    "streams": {"disconnect_grace_s": 2.0},
    "dispatch": {"load_interval_s": 0.2},
    "billing": {"replica_hour_usd": 3.6, "prices": PRICES},
    "tiers": {
        "free": {
            "priority": 1,
            "weight": 2,
            "on_quota_outage": "closed",
            "user_limits": {"concurrent_requests": 1, "requests_per_minute": 1000, "tokens_per_minute": 1_000_000},
        }
    },
}


@dataclass
class Platform:
    base: str
    kind: str
    log: Path
    keys: dict[str, str] = field(default_factory=dict)  # "paid" / "free" / "other" -> API key
    replicas: list[str] = field(default_factory=list)  # fleet: replica base URLs
    prefix: str = ""  # fleet: this run's Redis key prefix
    database_url: str = ""  # tenants and usage

    def admin(self, method: str, path: str, **kwargs) -> httpx.Response:
        return httpx.request(
            method,
            f"{self.base}/admin/v1{path}",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=10,
            **kwargs,
        )

    def new_key(self, org: str, user: str, tier: str) -> str:
        response = self.admin("POST", "/keys", json={"org": org, "user": user, "tier": tier})
        assert response.status_code == 201, response.text
        return response.json()["key"]

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[who]}"}


def new_api_key(base: str, org: str = "acme", user: str = "ann", tier: str = "paid") -> str:
    """An API key made through a running gateway's admin API."""
    response = httpx.post(
        f"{base}/admin/v1/keys",
        json={"org": org, "user": user, "tier": tier},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert response.status_code == 201, response.text
    return response.json()["key"]


def gateway_process(config_path: Path, port: int, log_path: Path):
    """`tokenfleet gateway --config` as a context manager, once it answers /health."""
    return running_process(["gateway", "--config", str(config_path)], f"http://127.0.0.1:{port}/health", log_path)


def replica_args(model_dir, port: int) -> list[str]:
    return [
        "replica",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--kv-cache-gib",
        "0.05",
        "--swap-space-gib",
        "0.01",
        "--max-model-len",
        "512",
        "--drain-timeout",
        "20",
    ]


def with_tenants(platform: Platform) -> Platform:
    run = uuid.uuid4().hex[:8]
    platform.keys = {
        "paid": platform.new_key(f"acme-{run}", "ann", "paid"),
        "free": platform.new_key(f"hobby-{run}", "bob", "free"),
        "other": platform.new_key(f"rival-{run}", "eve", "paid"),
    }
    return platform


@contextmanager
def running_fleet(model_dir, logs: Path, settings: dict):
    """Two replicas and a gateway as processes, tenants in a PostgreSQL database of their own, quotas and streams in
    Redis under a fresh prefix; `settings` go into the fleet file. Yields the Platform (no tenants yet)."""
    prefix = f"tokenfleet-test:{uuid.uuid4().hex}:"
    ports, gateway_port = [free_port(), free_port()], free_port()
    database = create_postgres_database()
    config = {
        "model_name": MODEL,
        "model_path": str(model_dir),
        "port": gateway_port,
        "replicas": [f"http://127.0.0.1:{p}" for p in ports],
        "redis_url": "redis://127.0.0.1:6379/0",
        "redis_prefix": prefix + "stream:",
        "database_url": database_url(database),
        **settings,
        "quota": {"prefix": prefix + "quota:"},
        "metering": {"stream_key": prefix + "usage"},
    }
    (logs / "fleet.yaml").write_text(yaml.safe_dump(config))
    try:
        with (
            running_process(replica_args(model_dir, ports[0]), f"http://127.0.0.1:{ports[0]}/health", logs / "r0.log"),
            running_process(replica_args(model_dir, ports[1]), f"http://127.0.0.1:{ports[1]}/health", logs / "r1.log"),
            running_process(
                ["gateway", "--config", str(logs / "fleet.yaml")],
                f"http://127.0.0.1:{gateway_port}/health",
                logs / "gateway.log",
            ),
        ):
            yield Platform(
                f"http://127.0.0.1:{gateway_port}",
                "fleet",
                logs / "gateway.log",
                replicas=[f"http://127.0.0.1:{p}" for p in ports],
                prefix=prefix,
                database_url=database_url(database),
            )
    finally:
        delete_redis_keys(prefix)
        drop_postgres_database(database)


@pytest.fixture(scope="session")
def fleet(demo_model_dir, tmp_path_factory):
    """Two replicas and a gateway as processes; tenants in PostgreSQL, quotas and streams in Redis."""
    with running_fleet(demo_model_dir, tmp_path_factory.mktemp("fleet"), TENANCY) as platform:
        yield with_tenants(platform)


@contextmanager
def serving_with_auth(model_dir, logs: Path, config: dict):
    """`tokenfleet serve --auth` with `config` as its fleet file: one process, keys in SQLite, quotas in memory."""
    (logs / "fleet.yaml").write_text(yaml.safe_dump(config))
    port = free_port()
    args = [
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--kv-cache-gib",
        "0.05",
        "--swap-space-gib",
        "0.01",
        "--max-model-len",
        "512",
        "--auth",
        "--config",
        str(logs / "fleet.yaml"),
        "--database-url",
        f"sqlite:///{logs / 'tenants.db'}",
    ]
    with running_process(args, f"http://127.0.0.1:{port}/health", logs / "serve.log"):
        yield Platform(
            f"http://127.0.0.1:{port}", "embedded", logs / "serve.log", database_url=f"sqlite:///{logs / 'tenants.db'}"
        )


@pytest.fixture(scope="session")
def embedded(demo_model_dir, tmp_path_factory):
    with serving_with_auth(demo_model_dir, tmp_path_factory.mktemp("embedded"), TENANCY) as platform:
        yield with_tenants(platform)


@pytest.fixture(params=["embedded", "fleet"])
def platform(request) -> Platform:
    return request.getfixturevalue(request.param)
