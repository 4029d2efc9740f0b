"""One request id from end to end: the id the gateway gives a request (its x-request-id) is in the gateway's log
lines about it, travels to the replica (the x-request-id header), which uses it for its own log lines and as the
prefix of its engine requests' ids, and is the usage row's id."""

from __future__ import annotations

import asyncio
import io
import logging
import time
from pathlib import Path

import httpx
from sqlalchemy import select

from tests.gateway.conftest import MODEL
from tokenfleet.logs import REQUEST_ID, log_handler, valid_request_id
from tokenfleet.store.db import Database
from tokenfleet.store.models import UsageEventRow


def lines_with(path: Path, text: str, timeout_s: float = 15.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [line for line in path.read_text().splitlines() if text in line]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def usage_row(database_url: str, request_id: str, timeout_s: float = 20.0) -> UsageEventRow | None:
    async def read() -> UsageEventRow | None:
        async with Database(database_url) as db:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                async with db.session() as session:
                    query = select(UsageEventRow).where(UsageEventRow.request_id == request_id)
                    row = (await session.execute(query)).scalar_one_or_none()
                if row is not None:
                    return row
                await asyncio.sleep(0.3)
        return None

    return asyncio.run(read())


def test_the_gateways_request_id_is_in_every_log_and_the_usage_row(fleet):
    response = httpx.post(
        f"{fleet.base}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        headers=fleet.auth("paid"),
        timeout=30,
    )
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    assert lines_with(fleet.log, f"[{request_id}] "), "the gateway's log has no line about the request"
    replica_logs = [fleet.log.parent / "r0.log", fleet.log.parent / "r1.log"]
    started = [line for log in replica_logs for line in lines_with(log, f"[{request_id}] request started", 5)]
    finished = [line for log in replica_logs for line in lines_with(log, f"[{request_id}] request finished", 5)]
    assert len(started) == 1 and len(finished) == 1, "the replica did not log the gateway's id"
    assert "4 generated tokens" in finished[0]
    row = usage_row(fleet.database_url, request_id)
    assert row is not None and row.output_tokens == 4


def test_log_lines_name_the_request_their_task_works_for():
    out, log = io.StringIO(), logging.getLogger("tokenfleet.test_request_id")
    log.addHandler(log_handler(out))
    log.setLevel(logging.INFO)

    async def work(request_id: str) -> None:
        REQUEST_ID.set(request_id)
        await asyncio.sleep(0)
        log.info("working")

    async def main() -> None:
        await asyncio.gather(work("req-a"), work("req-b"))
        log.info("between requests")

    asyncio.run(main())
    text = out.getvalue()
    assert "[req-a] working" in text and "[req-b] working" in text
    assert "tokenfleet.test_request_id: between requests" in text


def test_only_safe_ids_from_outside_are_used():
    assert valid_request_id("chatcmpl-0af3") == "chatcmpl-0af3"
    for bad in (None, "", "a b", "x\r\nset-cookie: y", "é", "-starts-with-dash", "a" * 129):
        assert valid_request_id(bad) is None
