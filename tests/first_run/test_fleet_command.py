"""A local fleet in one command (issue 23 point 4): `tokenfleet fleet` creates its database, starts replicas and a
gateway against the local Redis and PostgreSQL, prints where they are and an admin key, and stops everything on
Ctrl-C; `tokenfleet db init` creates and migrates a database; `tokenfleet gateway` with a missing database or an
unreachable Redis says so in one line and exits non-zero."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import asyncpg
import httpx
import pytest
import yaml

from tests.servers import _die_with_parent, delete_redis_keys, free_port
from tests.store.backends import POSTGRES_ADMIN_URL, blocking, database_url, drop_postgres_database


def tokenfleet(*args: str, home, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenfleet", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean_env(), "HOME": str(home), **env},
    )


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("TOKENFLEET_DATABASE_URL", "TOKENFLEET_ADMIN_KEY")}


async def tables(url: str) -> set[str]:
    conn = await asyncpg.connect(url, timeout=5)
    try:
        rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    finally:
        await conn.close()
    return {row["tablename"] for row in rows}


async def database_exists(name: str) -> bool:
    conn = await asyncpg.connect(POSTGRES_ADMIN_URL, timeout=5)
    try:
        return bool(await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name))
    finally:
        await conn.close()


@pytest.fixture
def fresh_database():
    """The name of a PostgreSQL database that does not exist yet (dropped after the test if it was created)."""
    name = f"tftest_{uuid.uuid4().hex}"
    yield name
    drop_postgres_database(name)
    delete_redis_keys(f"tokenfleet:{name}:")


def test_db_init_creates_a_missing_database_then_only_migrates(fresh_database, tmp_path):
    url = database_url(fresh_database)
    first = tokenfleet("db", "init", "--database-url", url, home=tmp_path)
    assert first.returncode == 0 and "created and migrated" in first.stdout, first.stderr
    assert {"organisations", "api_keys", "alembic_version"} <= blocking(tables(url))
    again = tokenfleet("db", "init", "--database-url", url, home=tmp_path)
    assert again.returncode == 0 and again.stdout.startswith("migrated"), again.stderr


def test_db_init_of_a_serve_data_dir_makes_its_sqlite_file(tmp_path):
    done = tokenfleet("db", "init", "--data-dir", str(tmp_path / "instance"), home=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "instance" / "tokenfleet.db").is_file()


def fleet_file(tmp_path, model_dir, **settings) -> str:
    config = {"model_name": "tiny", "model_path": str(model_dir), "replicas": ["http://127.0.0.1:9"], **settings}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def assert_one_clear_line(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("tokenfleet gateway: error: ")
    for word in words:
        assert word in lines[0], lines[0]


def test_gateway_with_a_missing_database_says_so_in_one_line(fresh_database, demo_model_dir, tmp_path):
    config = fleet_file(tmp_path, demo_model_dir, database_url=database_url(fresh_database))
    done = tokenfleet("gateway", "--config", config, home=tmp_path)
    assert_one_clear_line(
        done, f"the database '{fresh_database}' does not exist", f"tokenfleet db init --config {config}"
    )
    assert not blocking(database_exists(fresh_database)), "the gateway created the database silently"


def test_gateway_with_redis_unreachable_says_so_in_one_line(postgres_url, demo_model_dir, tmp_path):
    config = fleet_file(
        tmp_path, demo_model_dir, database_url=postgres_url, redis_url=f"redis://127.0.0.1:{free_port()}/0"
    )
    done = tokenfleet("gateway", "--config", config, home=tmp_path)
    assert_one_clear_line(done, "cannot reach Redis at 127.0.0.1:", "remove redis_url from")


class Output:
    """A process's output, read on a thread, so a test can wait for a line."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, proc: subprocess.Popen, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} (exit {proc.poll()}):\n{self.text[-4000:]}")
            time.sleep(0.2)

    @property
    def text(self) -> str:
        return "".join(self.lines)


def listening(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
    except httpx.ConnectError:
        return False
    return True


def free_run(count: int) -> int:
    """A first port of `count` consecutive free ones."""
    for _ in range(50):
        first = free_port()
        if all(not listening(first + i) for i in range(count)):
            return first
    raise RuntimeError("no run of free ports")


def test_fleet_starts_everything_serves_and_stops_on_ctrl_c(fresh_database, demo_model_dir, tmp_path):
    gateway_port, replica_port = free_port(), free_run(2)
    url = database_url(fresh_database)
    args = ["--replicas", "2", "--model", str(demo_model_dir), "--served-model-name", "tiny"]
    args += ["--port", str(gateway_port), "--replica-port", str(replica_port), "--database-url", url]
    args += ["--data-dir", str(tmp_path / "fleet"), "--", "--max-model-len", "512", "--kv-cache-gib", "0.05"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenfleet", "fleet", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**clean_env(), "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"},
        preexec_fn=_die_with_parent,
    )
    output = Output(proc)
    try:
        output.wait_for("Ctrl-C stops the fleet.", proc, timeout=300)
        assert f"database {url}: created and migrated" in output.text
        assert f"OpenAI API   http://127.0.0.1:{gateway_port}/v1" in output.text
        assert f"http://127.0.0.1:{replica_port}, http://127.0.0.1:{replica_port + 1}" in output.text
        admin_key = re.search(r"admin key\s+(\S+)", output.text).group(1)
        assert "| " in output.text  # each child's log lines come under its name

        listed = httpx.get(
            f"http://127.0.0.1:{gateway_port}/admin/v1/keys", headers={"Authorization": f"Bearer {admin_key}"}
        )
        assert listed.status_code == 200, listed.text
        fleet_yaml = tmp_path / "fleet" / "fleet.yaml"
        created = tokenfleet(
            "keys", "create", "--config", str(fleet_yaml), "--org", "acme", "--user", "ann", home=tmp_path
        )
        key = next(line for line in created.stdout.splitlines() if line.startswith("tf-"))
        reply = httpx.post(
            f"http://127.0.0.1:{gateway_port}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0, output.text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output.thread.join(timeout=5)
    assert "tokenfleet fleet: stopped" in output.text
    assert not any(listening(port) for port in (gateway_port, replica_port, replica_port + 1))
    assert "Traceback" not in output.text, output.text[-3000:]
