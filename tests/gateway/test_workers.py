"""`tokenfleet gateway --workers N`: N whole gateways on one port sharing Redis and PostgreSQL, connections spread
over them by the kernel, all stopped by a SIGTERM to the parent; and refused, in one line, where a worker would
keep quotas or resume streams in its own memory."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid

import httpx
import yaml

from tests.gateway.conftest import ADMIN_KEY, MODEL, Platform, replica_args
from tests.servers import delete_redis_keys, free_port, running_process
from tests.store.backends import create_postgres_database, database_url, drop_postgres_database


def test_workers_without_shared_stores_are_refused_in_one_line(demo_model_dir, tmp_path):
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump({"model_name": MODEL, "model_path": str(demo_model_dir), "replicas": []}))
    done = subprocess.run(
        [sys.executable, "-m", "tokenfleet", "gateway", "--config", str(config), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "--workers 2 needs redis_url" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_two_workers_share_the_port_and_stop_together(demo_model_dir, tmp_path):
    prefix = f"tokenfleet-test:{uuid.uuid4().hex}:"
    replica_port, port = free_port(), free_port()
    database = create_postgres_database()
    config = {
        "model_name": MODEL,
        "model_path": str(demo_model_dir),
        "port": port,
        "replicas": [f"http://127.0.0.1:{replica_port}"],
        "redis_url": "redis://127.0.0.1:6379/0",
        "redis_prefix": prefix + "stream:",
        "database_url": database_url(database),
        "quota": {"prefix": prefix + "quota:"},
        "metering": {"stream_key": prefix + "usage"},
        "admin_key": ADMIN_KEY,
    }
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(config))
    log = tmp_path / "gateway.log"
    try:
        with (
            running_process(
                replica_args(demo_model_dir, replica_port),
                f"http://127.0.0.1:{replica_port}/health",
                tmp_path / "r.log",
            ),
            running_process(
                ["gateway", "--config", str(tmp_path / "fleet.yaml"), "--workers", "2"],
                f"http://127.0.0.1:{port}/health",
                log,
            ) as parent,
        ):
            platform = Platform(f"http://127.0.0.1:{port}", "fleet", log)
            key = {"Authorization": f"Bearer {platform.new_key(f'acme-{prefix[-9:-1]}', 'ann', 'paid')}"}
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            for _ in range(24):  # a new connection each time: the kernel picks a worker for each
                response = httpx.post(f"{platform.base}/v1/chat/completions", json=body, headers=key, timeout=30)
                assert response.status_code == 200, response.text
            routed_by = set(re.findall(r"\[worker (\d)\] tokenfleet\.gateway\.routing: \[", log.read_text()))
            assert routed_by == {"0", "1"}, f"requests were served by workers {routed_by}"
            workers = worker_pids(parent.pid)
            assert len(workers) == 2
        assert parent.returncode is not None
        assert all(not alive(pid) for pid in workers), "a worker outlived the gateway"
    finally:
        delete_redis_keys(prefix)
        drop_postgres_database(database)


def worker_pids(parent: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in children if "spawn_main" in open(f"/proc/{pid}/cmdline").read()]  # not the tracker


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return "zombie" not in status.read()
    except FileNotFoundError:
        return False
