"""The gateway meters every request it admits, end to end: a real engine behind the in-process replica, the real
outbox, log and warehouse on SQLite and PostgreSQL. A cancelled stream is billed exactly the tokens it delivered,
and its quota reservation is reconciled with the same numbers."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from sqlalchemy import select

from tests.gateway.inprocess import MODEL, inprocess_gateway
from tests.metering.helpers import eventually
from tokenfleet.api.errors import APIError
from tokenfleet.engine.async_engine import AsyncEngine
from tokenfleet.engine.config import EngineConfig
from tokenfleet.gateway.upstream import InProcessUpstream
from tokenfleet.metering.settings import MeteringSettings
from tokenfleet.quota.memory import MemoryQuota
from tokenfleet.replica.server import ReplicaService
from tokenfleet.store.db import Database
from tokenfleet.store.models import UsageEventRow

pytestmark = pytest.mark.anyio


class ObservedQuota(MemoryQuota):
    """The in-memory quota, remembering what each request was reconciled with."""

    def __init__(self) -> None:
        super().__init__()
        self.reconciled: dict[str, int] = {}

    async def reconcile(self, reservation, used_tokens: int) -> None:
        self.reconciled[reservation.request_id] = used_tokens
        await super().reconcile(reservation, used_tokens)


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    engine = AsyncEngine(
        EngineConfig.from_options(str(demo_model_dir), kv_cache_gib=0.05, swap_space_gib=0.01, max_model_len=512)
    )
    yield engine
    engine.shutdown()


@pytest.fixture
def built(engine, db_url: str):
    """An open gateway on the free tier (so quotas apply) over the real engine, metering into the test database
    (built outside the test's event loop, as the CLI does: start-up migrates in its own loop)."""
    quota = ObservedQuota()
    gateway = inprocess_gateway(
        engine.engine.config.model,
        [InProcessUpstream(ReplicaService(engine, MODEL))],
        open_tier="free",
        quota=quota,
        database_url=db_url,
        metering=MeteringSettings(lease_s=2.0, checkpoint_s=0.2, ship_interval_s=0.05),
    )
    return gateway, quota


@pytest.fixture
async def metered(built, db: Database):
    """That gateway with its background services running, as while serving."""
    gateway, quota = built
    tasks = [asyncio.ensure_future(service()) for service in gateway.services]
    yield gateway, quota
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for close in gateway.closers:
        await close()


async def warehouse_row(db: Database, request_id: str) -> UsageEventRow:
    async def written() -> bool:
        async with db.session() as session:
            return await session.get(UsageEventRow, request_id) is not None

    await eventually(written, timeout_s=15, what=f"the usage row of {request_id}")
    async with db.session() as session:
        return (await session.execute(select(UsageEventRow).where(UsageEventRow.request_id == request_id))).scalar_one()


def chat(max_tokens: int, **extra) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


async def test_a_finished_request_is_one_row_with_its_counts_timing_and_route(metered, db):
    gateway, quota = metered
    caller = gateway.auth.open_caller
    relay = await gateway.admit("chat", chat(6, ignore_eos=True), caller)
    response = await gateway.streams.complete(relay, "chat")
    row = await warehouse_row(db, relay.request_id)
    assert (row.input_tokens, row.output_tokens) == (response["usage"]["prompt_tokens"], 6)
    assert row.status == "finished" and row.org_id == "local" and row.tier == "free" and row.model == MODEL
    assert "engine_s" not in response["usage"]  # metering's own number never reaches the client
    assert row.engine_s > 0 and 0 < row.ttft_s <= row.latency_s
    assert row.replica == "local" and "replica=local" in row.route
    assert quota.reconciled[relay.request_id] == row.input_tokens + row.output_tokens


async def test_a_cancelled_stream_bills_exactly_the_tokens_it_delivered(metered, db):
    gateway, quota = metered
    body = chat(300, ignore_eos=True, stream=True, logprobs=True)
    relay = await gateway.admit("chat", body, gateway.auth.open_caller)
    async for event in gateway.buffer.read(relay.request_id, 0):
        if event.id >= 5:
            break
    assert relay.cancel("api")
    await relay.finished.wait()
    delivered = 0  # every token a client could have read: each chunk's logprobs list one entry per token
    async for event in gateway.buffer.read(relay.request_id, 0):
        if event.data != "[DONE]":
            delivered += sum(len((c.get("logprobs") or {}).get("content") or []) for c in _choices(event.data))
    row = await warehouse_row(db, relay.request_id)
    assert row.status == "cancelled"
    assert 5 <= row.output_tokens == delivered < 300
    assert quota.reconciled[relay.request_id] == row.input_tokens + row.output_tokens


async def test_a_request_that_never_ran_is_recorded_as_failed_without_tokens(metered, db, monkeypatch):
    gateway, _ = metered

    async def refuse(body, prompt):
        return "refused by policy"

    monkeypatch.setattr(gateway, "safety", refuse)
    with pytest.raises(APIError):
        await gateway.admit("chat", chat(4), gateway.auth.open_caller)
    async with db.session() as session:
        await eventually(lambda: _count(db), what="the refused request's row")
        [row] = (await session.execute(select(UsageEventRow))).scalars().all()
    assert (row.status, row.input_tokens, row.output_tokens, row.route) == ("failed", 0, 0, "")


async def _count(db: Database) -> bool:
    async with db.session() as session:
        return bool((await session.execute(select(UsageEventRow.request_id))).first())


def _choices(data: str) -> list[dict]:
    import json

    with contextlib.suppress(ValueError):
        return json.loads(data).get("choices") or []
    return []
