"""Admission inside one gateway, in process (ASGI): the tier's priority class reaches the replica whatever the
client sends, a quota outage is answered as each tier's policy says (503 or a local limiter, never a 500 or a
hang), and every reservation is reconciled with what the request used — finished, refused or failed."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.gateway.inprocess import inprocess_gateway, multi_model_gateway
from tokenfleet.config import default_tiers
from tokenfleet.dispatch.overload import OverloadSettings
from tokenfleet.gateway.app import Gateway, create_gateway_app
from tokenfleet.quota.failover import FailoverQuota
from tokenfleet.quota.memory import MemoryQuota
from tokenfleet.quota.redis import RedisQuota
from tokenfleet.router.settings import RoutingSettings, Shadow


class RecordingUpstream:
    """Stands in for a replica: answers `count` tokens and remembers every body it was sent."""

    name = "recording"
    kind = "tokenfleet"

    def __init__(self, count: int = 3, fail: bool = False, name: str = "recording") -> None:
        self.count, self.fail, self.bodies, self.name = count, fail, [], name

    async def stream(self, kind: str, body: dict):
        self.bodies.append(body)
        if self.fail:
            raise ConnectionError("replica died")
        for i in range(self.count):
            yield content_chunk(i)
        yield usage_chunk(self.count)

    async def load(self) -> dict:
        return {"queued_prefill_tokens": 0}


def content_chunk(i: int) -> dict:
    """A fake replica's i-th token (t0, t1, ...) with its running usage (5 prompt tokens)."""
    return {
        "id": "x",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}],
        "usage": {"prompt_tokens": 5, "completion_tokens": i + 1, "total_tokens": 6 + i},
    }


def usage_chunk(sent: int) -> dict:
    return {
        "id": "x",
        "choices": [],
        "usage": {"prompt_tokens": 5, "completion_tokens": sent, "total_tokens": 5 + sent},
    }


def gateway(demo_model_dir, quota, tier: str, upstream=None) -> Gateway:
    return inprocess_gateway(demo_model_dir, [upstream or RecordingUpstream()], open_tier=tier, quota=quota)


async def post(gw: Gateway, **extra) -> httpx.Response:
    transport = httpx.ASGITransport(app=create_gateway_app(gw))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **extra},
        )


def test_under_overload_free_requests_move_to_the_smaller_model_with_a_cap(demo_model_dir):
    async def scenario():
        big, small = RecordingUpstream(name="big-1"), RecordingUpstream(name="small-1")
        gw = multi_model_gateway(
            demo_model_dir,
            {"big": [big], "small": [small]},
            open_tier="free",
            overload=OverloadSettings(free_model="small", free_max_tokens=2),
        )
        assert (await post(gw, model="big", max_tokens=50)).headers["x-tokenfleet-model"] == "big"
        gw.admission.ladder.level = 2  # step 2 of the ladder
        moved = await post(gw, model="big", max_tokens=50)
        assert moved.status_code == 200 and moved.headers["x-tokenfleet-model"] == "small"
        assert small.bodies[-1]["model"] == "small" and small.bodies[-1]["max_tokens"] == 2
        assert len(big.bodies) == 1

    asyncio.run(scenario())


def test_shadow_traffic_copies_the_prompt_and_records_the_candidates_latency(demo_model_dir):
    async def scenario():
        primary, candidate = RecordingUpstream(name="p"), RecordingUpstream(name="c")
        gw = multi_model_gateway(
            demo_model_dir,
            {"tiny": [primary], "next": [candidate]},
            routing=RoutingSettings(shadow=[Shadow("tiny", "next", 100)]),
        )
        response = await post(gw)
        assert response.json()["choices"][0]["message"]["content"] == "t0t1t2", "the primary answers"
        for _ in range(100):
            if candidate.bodies and b'what="ttft"' in gw.render_metrics():
                break
            await asyncio.sleep(0.01)
        assert candidate.bodies[0]["model"] == "next"
        assert candidate.bodies[0]["messages"] == primary.bodies[0]["messages"]
        assert b'tokenfleet_shadow_latency_seconds_count{model="next",what="ttft"} 1.0' in gw.render_metrics()

    asyncio.run(scenario())


def test_the_tier_sets_the_engine_priority_not_the_client(demo_model_dir):
    async def scenario():
        upstream = RecordingUpstream()
        gw = gateway(demo_model_dir, MemoryQuota(), "free", upstream)
        response = await post(gw, priority=-100)
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "t0t1t2"
        assert upstream.bodies[0]["priority"] == default_tiers()["free"].priority

    asyncio.run(scenario())


def test_a_quota_outage_fails_closed_or_open_by_tier(demo_model_dir):
    async def scenario(tier: str) -> httpx.Response:
        dead = RedisQuota.from_url("redis://127.0.0.1:1", "tftest:outage:")  # nothing listens there
        policy = {name: t.on_quota_outage for name, t in default_tiers().items()}
        quota = FailoverQuota(dead, MemoryQuota(), policy)
        started = time.monotonic()
        response = await post(gateway(demo_model_dir, quota, tier))
        assert time.monotonic() - started < 2.0, "an outage must not hang a request"
        second = await post(gateway(demo_model_dir, quota, tier))
        assert second.status_code == response.status_code, "the breaker keeps the same answer without waiting"
        await quota.close()
        return response

    closed = asyncio.run(scenario("free"))
    assert closed.status_code == 503 and closed.json()["error"]["code"] == "service_unavailable"
    assert asyncio.run(scenario("paid")).status_code == 200, "paid fails open onto the local limiter"


def test_every_ending_reconciles_the_reservation(demo_model_dir):
    """What the request used goes back to the quota: its tokens when it finished, nothing when the replica
    failed before producing any, and no slot or concurrency lease is left behind either way."""

    async def scenario():
        quota = MemoryQuota()
        reconciled = []
        original = quota.reconcile

        async def recording(reservation, used):
            reconciled.append((reservation.tokens, used))
            await original(reservation, used)

        quota.reconcile = recording
        ok = gateway(demo_model_dir, quota, "paid")
        assert (await post(ok)).status_code == 200
        failing = gateway(demo_model_dir, quota, "paid", RecordingUpstream(fail=True))
        assert (await post(failing)).status_code == 502
        for _ in range(50):
            if len(reconciled) == 2:
                break
            await asyncio.sleep(0.01)
        prompt = len(reconciled) and reconciled[0][0] - 3
        assert reconciled == [(prompt + 3, 5 + 3), (prompt + 3, 0)]
        for gw in (ok, failing):
            assert gw.admission.dispatchers["tiny"].snapshot().in_use == 0

    asyncio.run(scenario())
