"""SIGKILL of a tensor-parallel replica's worker rank mid-stream: the replica reports itself unhealthy within seconds
and the gateway continues the stream on another replica (a `retrying` event), with the same greedy text as the
healthy replica gives alone and one usage row for the request.

The fleet: a gateway (this test's own Redis and PostgreSQL database) in front of two replicas of the demo model, one
split over two ranks (`--tensor-parallel-size 2`: the engine process is rank 0, rank 1 a worker process under it),
one plain. The plain replica is drained while the request starts, so that it lands on the TP replica."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import yaml

from tests.chaos.harness import Fleet, RedisProcess, check_no_relay_left, usage_rows
from tests.gateway.conftest import ADMIN_KEY, MODEL, replica_args
from tests.servers import _die_with_parent, descendants, free_port, wait_healthy
from tests.store.backends import create_postgres_database, database_url, drop_postgres_database

MAX_TOKENS = 600  # long enough that the TP replica is still generating when its rank is killed, even when quiet
KILL_AFTER_CHUNKS = 5
UNHEALTHY_WITHIN_S = 5.0
PROMPT = "Tell me a long story about a lighthouse keeper"
ROUTING = {
    "replica_timeout_s": 10,
    "load_interval_s": 0.2,
    "max_retries": 2,
    "health": {"check_interval_s": 0.5, "check_timeout_s": 0.5},
}


@dataclass
class TPFleet:
    fleet: Fleet
    tp_replica: str  # base URL of the replica split over two ranks
    plain_replica: str
    tp_process: subprocess.Popen  # the TP replica's server process (its engine process and worker rank are below it)


@dataclass
class StreamSeen:
    """What the SDK client read of one streamed chat completion."""

    request_id: str = ""
    text: str = ""
    retrying: list[dict] = field(default_factory=list)
    usage_chunks: list = field(default_factory=list)
    finish_reason: str | None = None


@contextlib.contextmanager
def tp_fleet(model_dir: Path, logs: Path):
    redis_server = RedisProcess(logs)
    redis_server.start()
    database = create_postgres_database()
    tp_port, plain_port, port = free_port(), free_port(), free_port()
    tp_url, plain_url = f"http://127.0.0.1:{tp_port}", f"http://127.0.0.1:{plain_port}"
    config = {
        "model_name": MODEL,
        "model_path": str(model_dir),
        "port": port,
        "replicas": [tp_url, plain_url],
        "redis_url": redis_server.url,
        "database_url": database_url(database),
        "admin_key": ADMIN_KEY,
        "routing": ROUTING,
        "metering": {"lease_s": 2.0, "checkpoint_s": 0.25, "ship_interval_s": 0.1},
    }
    (logs / "fleet.yaml").write_text(yaml.safe_dump(config))
    longer = ["--max-model-len", "2048"]  # room for MAX_TOKENS
    replicas = [
        ([*replica_args(model_dir, tp_port), *longer, "--tensor-parallel-size", "2"], tp_url, logs / "tp_replica.log"),
        ([*replica_args(model_dir, plain_port), *longer], plain_url, logs / "plain_replica.log"),
    ]
    try:
        with replicas_running(replicas) as [tp_process, _]:
            fleet = Fleet(f"http://127.0.0.1:{port}", logs, redis_server, database_url(database), logs / "fleet.yaml")
            yield TPFleet(fleet, tp_url, plain_url, tp_process)
    finally:
        redis_server.stop()
        drop_postgres_database(database)


@contextlib.contextmanager
def replicas_running(replicas: list[tuple[list[str], str, Path]]):
    """`python -m tokenfleet ARGS` for each (args, base URL, log), all started at once so that their start-ups
    overlap, then each waited for until healthy; stopped when the block ends."""
    procs: list[subprocess.Popen] = []
    try:
        for args, _, log_path in replicas:
            with open(log_path, "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tokenfleet", *args],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, "PYTHONUNBUFFERED": "1"},
                        preexec_fn=_die_with_parent,
                    )
                )
        for proc, (_, url, log_path) in zip(procs, replicas):
            wait_healthy(proc, f"{url}/health", log_path, timeout=120)
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def worker_ranks(pid: int) -> list[int]:
    """The tensor-parallel worker processes below `pid` (the server process; its engine process is rank 0)."""
    return [p for p in descendants(pid) if _is_worker_rank(p)]


def _is_worker_rank(pid: int) -> bool:
    try:
        return b"tokenfleet.engine.tp_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def drain(base: str, replica: str, draining: bool) -> None:
    response = httpx.post(
        f"{base}/admin/v1/replicas/drain",
        json={"replica": replica, "draining": draining},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=10,
    )
    assert response.status_code == 200, response.text


class HealthWatch:
    """Polls a replica's /health from start() on, in a thread; `unhealthy_after_s` is how long it took to turn
    non-200 (None while it has not)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.unhealthy_after_s: float | None = None
        self.status: int | None = None  # the first non-200 answer (0: no answer)
        self._started = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _poll(self) -> None:
        while not self._stop.is_set() and time.monotonic() - self._started < 3 * UNHEALTHY_WITHIN_S:
            try:
                status = httpx.get(f"{self.base}/health", timeout=1.0).status_code
            except httpx.HTTPError:
                status = 0  # no answer at all: unhealthy too
            if status != 200:
                self.unhealthy_after_s, self.status = time.monotonic() - self._started, status
                return
            time.sleep(0.05)


def request_kwargs() -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }


def read_stream(client: openai.OpenAI, midway) -> StreamSeen:
    """Streams the request; after KILL_AFTER_CHUNKS content chunks calls `midway()` once, then reads to the end."""
    seen = StreamSeen()
    raw = client.chat.completions.with_raw_response.create(
        stream=True, stream_options={"include_usage": True}, **request_kwargs()
    )
    seen.request_id = raw.headers["x-request-id"]
    content_chunks = 0
    for chunk in raw.parse():
        extra = chunk.model_extra or {}
        if "retrying" in extra:
            seen.retrying.append(extra["retrying"])
        if chunk.usage is not None and not chunk.choices:
            seen.usage_chunks.append(chunk.usage)
        for choice in chunk.choices:
            seen.text += choice.delta.content or ""
            seen.finish_reason = choice.finish_reason or seen.finish_reason
            content_chunks += 1
            if content_chunks == KILL_AFTER_CHUNKS:
                midway()
    return seen


def test_a_killed_rank_turns_the_replica_unhealthy_and_the_stream_goes_on_elsewhere(demo_model_dir, tmp_path):
    with tp_fleet(demo_model_dir, tmp_path) as setup, setup.fleet.gateway():
        fleet = setup.fleet
        [rank] = worker_ranks(setup.tp_process.pid)
        alone = openai.OpenAI(base_url=f"{setup.plain_replica}/v1", api_key="none", max_retries=0)
        expected = alone.chat.completions.create(**request_kwargs()).choices[0].message.content
        assert expected

        client = openai.OpenAI(base_url=f"{fleet.base}/v1", api_key=fleet.new_key(), max_retries=0, timeout=60)
        health = HealthWatch(setup.tp_replica)
        drain(fleet.base, setup.plain_replica, True)  # the request can only start on the TP replica ...

        def kill_rank() -> None:
            assert httpx.get(f"{setup.tp_replica}/load", timeout=5).json()["running"] == 1, "not on the TP replica"
            drain(fleet.base, setup.plain_replica, False)  # ... and can only go on on the plain one
            os.kill(rank, signal.SIGKILL)
            health.start()

        try:
            seen = read_stream(client, kill_rank)
        finally:
            health.stop()

        assert health.unhealthy_after_s is not None, "the TP replica still says it is healthy with a rank gone"
        assert health.unhealthy_after_s < UNHEALTHY_WITHIN_S, f"unhealthy only after {health.unhealthy_after_s:.1f} s"
        assert [r["attempt"] for r in seen.retrying] == [2], f"retrying events: {seen.retrying}"
        assert seen.finish_reason == "length"
        assert seen.text == expected
        assert len(seen.usage_chunks) == 1 and seen.usage_chunks[0].completion_tokens == MAX_TOKENS
        row = usage_rows(fleet, [seen.request_id])[seen.request_id]  # exactly one row (checked there)
        assert row.output_tokens == MAX_TOKENS and row.input_tokens > 0
        check_no_relay_left(fleet)
