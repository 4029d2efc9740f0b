"""A fleet for fault tests and the checks every fault test ends with.

The fleet: a redis-server of the test's own (so the test may kill and restart it; the shared Redis at 6379 is
never touched), a throwaway PostgreSQL database, one replica process, and a gateway process the test may kill
and start again. The checks (the bar of issue 18): every admitted request has exactly one usage row with at least
the tokens its client received, no relay is left running, every stream ended with [DONE] or an error event, and
no request got a plain-text 5xx or no response at all."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
import yaml
from sqlalchemy import select

from tests.gateway.conftest import ADMIN_KEY, MODEL, replica_args
from tests.servers import _die_with_parent, free_port, metric, running_process
from tests.store.backends import create_postgres_database, database_url, drop_postgres_database
from tokenfleet.store.db import Database
from tokenfleet.store.models import UsageEventRow, UsageOutboxRow


class RedisProcess:
    """`redis-server` on a free port, without persistence: a restart comes back empty, as after a crash."""

    def __init__(self, logs: Path) -> None:
        self.port, self.logs, self.starts = free_port(), logs, 0
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.starts += 1
        with open(self.logs / f"redis{self.starts}.log", "wb") as log:
            self.process = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        client.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.kill()


@dataclass
class Fleet:
    base: str
    logs: Path
    redis: RedisProcess
    database_url: str
    config_path: Path
    started: int = 0
    org_of: dict[str, str] = field(default_factory=dict)  # API key -> its organisation's id

    def gateway(self):
        """A context manager running a gateway process (a fresh one each call, on the same port)."""
        self.started += 1
        return running_process(
            ["gateway", "--config", str(self.config_path)],
            f"{self.base}/health",
            self.logs / f"gateway{self.started}.log",
        )

    def new_key(self, tier: str = "paid") -> str:
        org = f"chaos-{uuid.uuid4().hex[:8]}"
        response = httpx.post(
            f"{self.base}/admin/v1/keys",
            json={"org": org, "user": "u", "tier": tier},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=10,
        )
        assert response.status_code == 201, response.text
        key = response.json()["key"]
        self.org_of[key] = response.json()["org_id"]
        return key

    def active_relays(self) -> float:
        return metric(self.base, "tokenfleet_gateway_active_relays")


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and key in merged else value
    return merged


@contextlib.contextmanager
def chaos_fleet(model_dir: Path, logs: Path, **overrides):
    """A replica process beside this test's Redis and database; `overrides` are merged into fleet.yaml."""
    redis_server = RedisProcess(logs)
    redis_server.start()
    database = create_postgres_database()
    replica_port, port = free_port(), free_port()
    config = _merge(
        {
            "model_name": MODEL,
            "model_path": str(model_dir),
            "port": port,
            "replicas": [f"http://127.0.0.1:{replica_port}"],
            "redis_url": redis_server.url,
            "database_url": database_url(database),
            "admin_key": ADMIN_KEY,
            "streams": {"disconnect_grace_s": 0.5},
            "metering": {"lease_s": 2.0, "checkpoint_s": 0.25, "ship_interval_s": 0.1},
        },
        overrides,
    )
    (logs / "fleet.yaml").write_text(yaml.safe_dump(config))
    try:
        args = replica_args(model_dir, replica_port) + ["--max-model-len", "2048", "--kv-cache-gib", "0.1"]
        with running_process(args, f"http://127.0.0.1:{replica_port}/health", logs / "replica.log"):
            yield Fleet(f"http://127.0.0.1:{port}", logs, redis_server, database_url(database), logs / "fleet.yaml")
    finally:
        redis_server.stop()
        drop_postgres_database(database)


# --- clients ---------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one client saw of one request."""

    status: int | None = None  # None: no HTTP response at all
    headers: dict = field(default_factory=dict)
    events: list[tuple[int | None, str | None, str]] = field(default_factory=list)  # (id, event name, data)
    body: bytes = b""
    transport_error: str | None = None
    delivered: int = 0  # output tokens the client received (the last usage count it was sent)
    streamed: bool = True

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-request-id")

    @property
    def ended_cleanly(self) -> bool:
        """Ended with [DONE] or with an error event."""
        return any(data == "[DONE]" or name == "error" or _is_error(data) for _, name, data in self.events)

    def describe(self) -> str:
        tail = self.events[-3:] if self.streamed else self.body[:300]
        return f"status={self.status} error={self.transport_error} last={tail}"


def _is_error(data: str) -> bool:
    try:
        return "error" in json.loads(data)
    except (ValueError, TypeError):
        return False


def chat_body(max_tokens: int, stream: bool = True) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:  # usage on every chunk: what the client received, to compare with what it is billed
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def read_events(response: httpx.Response, outcome: Outcome, deadline: float | None = None) -> bool:
    """Parses the SSE stream into outcome.events (and outcome.delivered) until it ends (True), or until the
    time.monotonic() deadline passes (False; pings keep the loop turning while a stream is idle)."""
    event_id, name = None, None
    for line in response.iter_lines():
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
            outcome.events.append((event_id, name, data))
            outcome.delivered = max(outcome.delivered, _completion_tokens(data))
            event_id, name = None, None
        if deadline is not None and time.monotonic() > deadline:
            return False
    return True


def _completion_tokens(data: str) -> int:
    try:
        usage = json.loads(data).get("usage") or {}
    except (ValueError, TypeError, AttributeError):
        return 0
    return usage.get("completion_tokens", 0)


def stream_completion(base: str, key: str, max_tokens: int, timeout_s: float = 60.0) -> Outcome:
    outcome = Outcome()
    try:
        with httpx.stream(
            "POST",
            f"{base}/v1/chat/completions",
            json=chat_body(max_tokens),
            timeout=timeout_s,
            headers={"Authorization": f"Bearer {key}", "x-tokenfleet-resumable": "true"},
        ) as response:
            outcome.status, outcome.headers = response.status_code, dict(response.headers)
            if response.status_code != 200:
                outcome.body = response.read()
                return outcome
            read_events(response, outcome)
    except httpx.HTTPError as e:
        outcome.transport_error = f"{type(e).__name__}: {e}"
    return outcome


def plain_completion(base: str, key: str, max_tokens: int, timeout_s: float = 60.0) -> Outcome:
    outcome = Outcome(streamed=False)
    try:
        response = httpx.post(
            f"{base}/v1/chat/completions",
            json=chat_body(max_tokens, stream=False),
            headers={"Authorization": f"Bearer {key}"},
            timeout=timeout_s,
        )
        outcome.status, outcome.headers, outcome.body = response.status_code, dict(response.headers), response.content
        if response.status_code == 200:
            outcome.delivered = response.json()["usage"]["completion_tokens"]
            outcome.headers.setdefault("x-request-id", response.json()["id"])
    except httpx.HTTPError as e:
        outcome.transport_error = f"{type(e).__name__}: {e}"
    return outcome


def in_background(*calls):
    """Starts the calls (functions of no arguments returning an Outcome) in threads; returns a function that waits
    for them and returns their outcomes, in order."""
    outcomes: list[Outcome | None] = [None] * len(calls)

    def run(i: int) -> None:
        outcomes[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()

    def join() -> list[Outcome]:
        for thread in threads:
            thread.join()
        return outcomes

    return join


def in_threads(*calls) -> list[Outcome]:
    """Runs the calls at once; their outcomes, in order."""
    return in_background(*calls)()


def wait_for(check, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# --- the invariants ----------------------------------------------------------------------------------------------


def check_responses(outcomes: list[Outcome]) -> None:
    """Every request got an HTTP response; errors are OpenAI-shaped JSON, never plain text; every 200 stream
    ended with [DONE] or an error event."""
    for outcome in outcomes:
        assert outcome.status is not None, f"no HTTP response: {outcome.describe()}"
        if outcome.status != 200:
            assert outcome.headers.get("content-type", "").startswith("application/json"), outcome.describe()
            assert "error" in json.loads(outcome.body), outcome.describe()
        elif outcome.streamed:
            assert outcome.ended_cleanly, f"a stream ended with neither [DONE] nor an error: {outcome.describe()}"


async def _usage_rows(url: str, request_ids: list[str]) -> dict[str, list[UsageEventRow]]:
    async with Database(url) as db, db.session() as session:
        query = select(UsageEventRow).where(UsageEventRow.request_id.in_(request_ids))
        rows: dict[str, list[UsageEventRow]] = {}
        for row in (await session.execute(query)).scalars():
            rows.setdefault(row.request_id, []).append(row)
        return rows


def usage_rows(fleet: Fleet, request_ids: list[str], timeout_s: float = 30.0) -> dict[str, UsageEventRow]:
    """Waits until every request has its warehouse row; returns them (one each, checked)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = asyncio.run(_usage_rows(fleet.database_url, request_ids))
        missing = [r for r in request_ids if r not in rows]
        if not missing:
            break
        assert time.monotonic() < deadline, f"no usage row after {timeout_s} s for {missing}"
        time.sleep(0.3)
    assert all(len(rows[r]) == 1 for r in request_ids), "a request has more than one usage row"
    return {r: rows[r][0] for r in request_ids}


async def _rows_of_org(url: str, org_id: str) -> list[str]:
    async with Database(url) as db, db.session() as session:
        query = select(UsageEventRow.request_id).where(UsageEventRow.org_id == org_id)
        return list((await session.execute(query)).scalars())


def check_every_request_metered(fleet: Fleet, key: str, sent: int, timeout_s: float = 30.0) -> None:
    """The tenant's requests were all admitted: one usage row each, whatever the client got back (a request that
    failed after admission too; its client may never have learnt its id)."""
    deadline = time.monotonic() + timeout_s
    while len(rows := asyncio.run(_rows_of_org(fleet.database_url, fleet.org_of[key]))) < sent:
        assert time.monotonic() < deadline, f"{len(rows)} usage rows after {timeout_s} s for {sent} requests"
        time.sleep(0.3)
    assert len(rows) == sent, f"{len(rows)} usage rows for {sent} requests"


async def _outbox_payload(url: str, request_id: str) -> str | None:
    async with Database(url) as db, db.session() as session:
        query = select(UsageOutboxRow.payload).where(UsageOutboxRow.request_id == request_id)
        return (await session.execute(query)).scalar_one_or_none()


def outbox_event(fleet: Fleet, request_id: str) -> dict | None:
    """The request's event in the outbox as it stands (provisional while the request runs)."""
    payload = asyncio.run(_outbox_payload(fleet.database_url, request_id))
    return None if payload is None else json.loads(payload)


def check_metered(fleet: Fleet, outcomes: list[Outcome], timeout_s: float = 30.0) -> dict[str, UsageEventRow]:
    """One usage row per admitted request, billing at least the tokens its client received."""
    admitted = [o for o in outcomes if o.status == 200]
    rows = usage_rows(fleet, [o.request_id for o in admitted], timeout_s)
    for outcome in admitted:
        row = rows[outcome.request_id]
        assert row.output_tokens >= outcome.delivered, (
            f"{outcome.request_id}: billed {row.output_tokens} output tokens, the client received {outcome.delivered}"
        )
        assert row.input_tokens > 0, f"{outcome.request_id}: no input tokens billed"
    return rows


def check_no_relay_left(fleet: Fleet, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (active := fleet.active_relays()) > 0:
        assert time.monotonic() < deadline, f"{active} relay(s) still active on an idle gateway"
        time.sleep(0.1)
