"""`kill -9` of the gateway mid-stream: after a restart the request's usage row still appears, exactly once, with
the tokens counted up to the last checkpoint. Embedded (one `tokenfleet serve`, SQLite) and in a fleet (a gateway
process in front of a replica process, PostgreSQL and the Redis Stream)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from sqlalchemy import func, select

from tests.gateway.conftest import ADMIN_KEY, MODEL, replica_args
from tests.servers import delete_redis_keys, free_port, running_process
from tests.store.backends import create_postgres_database, database_url, drop_postgres_database
from tokenfleet.store.db import Database
from tokenfleet.store.models import UsageEventRow, UsageOutboxRow

METERING = {"lease_s": 1.5, "checkpoint_s": 0.2, "ship_interval_s": 0.1}


@contextlib.contextmanager
def embedded(model_dir: Path, logs: Path):
    """start() -> a fresh `tokenfleet serve` on the same SQLite file and port, each time it is called."""
    port, url = free_port(), f"sqlite:///{logs / 'usage.db'}"
    (logs / "fleet.yaml").write_text(yaml.safe_dump({"metering": METERING}))
    args = [
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--kv-cache-gib",
        "0.1",
        "--swap-space-gib",
        "0.01",
        "--max-model-len",
        "2048",
        "--config",
        str(logs / "fleet.yaml"),
        "--database-url",
        url,
    ]
    yield lambda n: running_process(args, f"http://127.0.0.1:{port}/health", logs / f"serve{n}.log"), port, url


@contextlib.contextmanager
def fleet(model_dir: Path, logs: Path):
    replica_port, port, prefix = free_port(), free_port(), f"tokenfleet-test:{uuid.uuid4().hex}:"
    database = create_postgres_database()
    config = {
        "model_name": MODEL,
        "model_path": str(model_dir),
        "port": port,
        "replicas": [f"http://127.0.0.1:{replica_port}"],
        "redis_url": "redis://127.0.0.1:6379/0",
        "redis_prefix": prefix + "stream:",
        "database_url": database_url(database),
        "admin_key": ADMIN_KEY,
        "quota": {"prefix": prefix + "quota:"},
        "metering": {**METERING, "stream_key": prefix + "usage"},
    }
    (logs / "fleet.yaml").write_text(yaml.safe_dump(config))
    try:
        replica = replica_args(model_dir, replica_port) + ["--max-model-len", "2048", "--kv-cache-gib", "0.1"]
        with running_process(replica, f"http://127.0.0.1:{replica_port}/health", logs / "replica.log"):
            yield (
                lambda n: running_process(
                    ["gateway", "--config", str(logs / "fleet.yaml")],
                    f"http://127.0.0.1:{port}/health",
                    logs / f"gateway{n}.log",
                ),
                port,
                database_url(database),
            )
    finally:
        delete_redis_keys(prefix)
        drop_postgres_database(database)


async def rows_of(url: str, request_id: str) -> tuple[list[UsageEventRow], int]:
    async with Database(url) as db, db.session() as session:
        rows = (await session.execute(select(UsageEventRow).where(UsageEventRow.request_id == request_id))).scalars()
        outbox = select(func.count()).where(UsageOutboxRow.request_id == request_id)
        return list(rows.all()), (await session.execute(outbox)).scalar_one()


def read_some_then_kill(process, port: int, key: str, token_events: int) -> str:
    """Starts a long stream, reads some events, waits for a checkpoint, then SIGKILLs the gateway. Returns the
    request id."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "A long story"}],
        "max_tokens": 1800,  # longer than the test takes
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    ) as response:
        assert response.status_code == 200, response.read()
        request_id, seen = response.headers["x-request-id"], 0
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen >= token_events:
                break
        time.sleep(0.6)  # at least two checkpoints of the counts so far
        process.kill()
        process.wait()
    return request_id


def api_key(kind: str, port: int) -> str:
    """The embedded server runs open (any key); the fleet's gateway needs one of its tenants' keys."""
    if kind == "embedded":
        return "unused"
    response = httpx.post(
        f"http://127.0.0.1:{port}/admin/v1/keys",
        json={"org": "crash", "user": "u", "tier": "paid"},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=10,
    )
    assert response.status_code == 201, response.text
    return response.json()["key"]


@pytest.mark.parametrize("kind", ["embedded", "fleet"])
def test_a_request_whose_gateway_was_killed_is_metered_once_after_restart(kind, demo_model_dir, tmp_path):
    setup = embedded if kind == "embedded" else fleet
    with setup(demo_model_dir, tmp_path) as (start, port, url):
        with start(1) as process:
            request_id = read_some_then_kill(process, port, api_key(kind, port), token_events=10)
        with start(2):
            deadline = time.monotonic() + 30
            rows, outbox = asyncio.run(rows_of(url, request_id))
            while not rows and time.monotonic() < deadline:
                time.sleep(0.3)
                rows, outbox = asyncio.run(rows_of(url, request_id))
            time.sleep(1.0)  # the reaper and the shipper keep running: nothing may double it
            rows, outbox = asyncio.run(rows_of(url, request_id))
    assert len(rows) == 1 and outbox == 1, f"{len(rows)} warehouse rows and {outbox} outbox rows"
    [row] = rows
    assert row.status == "failed" and row.output_tokens >= 10 and row.input_tokens > 0
