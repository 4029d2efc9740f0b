"""Generation stops when it must, in a fleet (gateway and replicas as processes, streams and quotas in Redis,
tenants in PostgreSQL): a client that hangs up or a cancel frees the relay, the tenant's concurrency slots and
the replica's sequences and KV blocks every time; a request without max_tokens stops (finish_reason "length") when
its tenant's token budget is used."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
import redis

from tests.gateway.conftest import ADMIN_KEY, MODEL, Platform, running_fleet
from tests.servers import metric

GRACE_S = 1.0
SETTLE_S = 5.0  # after the grace period, by when everything must be free again
BUDGET = 2700  # tokens per day (tier "daily") or per minute (tier "per_minute") of one user
# per minute: a small typical output admits many requests at once, each able to run to the end of the window (the
# overrun that refill alone would never explain)
TIERS = {
    "daily": {"priority": 0, "weight": 4, "user_limits": {"tokens_per_day": BUDGET}},
    "per_minute": {
        "priority": 0,
        "weight": 4,
        "typical_output_tokens": 64,
        "user_limits": {"tokens_per_minute": BUDGET},
    },
}
STOPS = {
    "admin_key": ADMIN_KEY,
    "streams": {"disconnect_grace_s": GRACE_S},
    "dispatch": {"load_interval_s": 0.2},
    "tiers": TIERS,
}


@pytest.fixture(scope="module")
def stops_fleet(demo_model_dir, tmp_path_factory):
    """Two replicas and a gateway as processes, with this module's tiers."""
    with running_fleet(demo_model_dir, tmp_path_factory.mktemp("stops"), STOPS) as platform:
        yield platform


# --- cancel and disconnect -----------------------------------------------------------------------------------------


def held(platform: Platform) -> dict[str, float]:
    """What stopped requests must give back: the gateway's relays, the tenants' concurrency leases in Redis (but the
    slots the gateway's own quota leases hold with no request in them), the replicas' sequences and KV blocks."""
    loads = [httpx.get(f"{r}/load", timeout=5).json() for r in platform.replicas]
    client = redis.Redis(host="127.0.0.1", port=6379)
    try:
        now, pattern = time.time(), platform.prefix + "quota:*:leases"
        leases = sum(client.zcount(key, now, "+inf") for key in client.scan_iter(match=pattern))
    finally:
        client.close()
    return {
        "relays": metric(platform.base, "tokenfleet_gateway_active_relays"),
        "leases": leases - metric(platform.base, "tokenfleet_quota_lease_free_slots"),
        "running": sum(load["running"] + load["waiting"] + load["swapped"] for load in loads),
        "kv_usage": sum(load["kv_usage"] for load in loads),
    }


def wait_until_free(platform: Platform, within_s: float) -> dict[str, float]:
    deadline = time.monotonic() + within_s
    while True:
        now = held(platform)
        if not any(now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


async def open_streams(
    platform: Platform, client: httpx.AsyncClient, key: str, count: int, chunks: int = 3
) -> list[tuple[str, httpx.Response]]:
    """`count` long streamed chat completions, each read until `chunks` chunks have come; still open."""

    async def one(i: int) -> tuple[str, httpx.Response]:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Go on {i}"}],
            "max_tokens": 480,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        request = client.build_request(
            "POST", f"{platform.base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        response = await client.send(request, stream=True)
        assert response.status_code == 200, await response.aread()
        seen, lines = 0, response.aiter_lines()
        while seen < chunks:
            seen += (await anext(lines)).startswith("data: ")
        return response.headers["x-request-id"], response

    return list(await asyncio.gather(*(one(i) for i in range(count))))


async def hang_up_round(platform: Platform, key: str, count: int, cancel: bool) -> None:
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
        streams = await open_streams(platform, client, key, count)
        if cancel:
            answers = await asyncio.gather(
                *(
                    client.post(
                        f"{platform.base}/v1/requests/{request_id}/cancel", headers={"Authorization": f"Bearer {key}"}
                    )
                    for request_id, _ in streams
                )
            )
            assert all(a.json()["cancelled"] is True for a in answers), [a.text for a in answers]
        for _, response in streams:
            await response.aclose()


def test_every_hang_up_and_cancel_frees_the_relay_the_leases_and_the_replica(stops_fleet: Platform):
    platform = stops_fleet
    key = new_key(platform, "paid")
    for round_ in range(6):
        cancel = round_ % 2 == 1  # the cancel API (and then a hang-up), or only the hang-up
        asyncio.run(hang_up_round(platform, key, 10, cancel))
        left = wait_until_free(platform, (0 if cancel else GRACE_S) + SETTLE_S)
        assert not any(left.values()), f"round {round_} ({'cancel' if cancel else 'hang up'}): still held {left}"


def new_key(platform: Platform, tier: str) -> str:
    return platform.new_key(f"org-{uuid.uuid4().hex[:8]}", "ann", tier)


# --- token budgets -------------------------------------------------------------------------------------------------


async def unbounded_stream(platform: Platform, client: httpx.AsyncClient, key: str, i: int) -> dict | None:
    """A streamed chat completion without max_tokens that would run to the end of the context window; None when it
    is refused (429), else what the client received: content chunks, finish reasons, the final usage."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Tell me a long story {i}"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "ignore_eos": True,
    }
    async with client.stream(
        "POST", f"{platform.base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as response:
        if response.status_code == 429:
            return None
        assert response.status_code == 200, await response.aread()
        got = {"content": 0, "finish": [], "usage": None, "done": False}
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                got["done"] = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                got["usage"] = chunk.get("usage") or got["usage"]
                for choice in chunk.get("choices", []):
                    got["content"] += bool(choice["delta"].get("content"))
                    if choice.get("finish_reason"):
                        got["finish"].append(choice["finish_reason"])
        return got


async def burst(platform: Platform, key: str, requests: int, at_once: int) -> list[dict | None]:
    limit = asyncio.Semaphore(at_once)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as client:

        async def one(i: int) -> dict | None:
            async with limit:
                return await unbounded_stream(platform, client, key, i)

        return list(await asyncio.gather(*(one(i) for i in range(requests))))


@pytest.mark.parametrize("tier", ["daily", "per_minute"])
def test_requests_without_max_tokens_stop_when_the_token_budget_is_used(stops_fleet: Platform, tier: str):
    """Many unbounded streams at once: together they are sent and charged no more than the budget (per minute: the
    bucket plus what refilled while they ran), each cut with finish_reason "length"."""
    platform = stops_fleet
    wait_until_free(platform, 60)  # whatever ran before has stopped
    key, started = new_key(platform, tier), time.monotonic()
    results = asyncio.run(burst(platform, key, requests=60, at_once=16))
    elapsed = time.monotonic() - started
    admitted = [r for r in results if r is not None]
    assert len(admitted) >= 5 and len(admitted) < len(results), f"{len(admitted)} of {len(results)} admitted"
    assert all(r["done"] and r["finish"] == ["length"] and r["usage"] for r in admitted), admitted
    assert all(r["content"] <= r["usage"]["completion_tokens"] for r in admitted), "sent more than was charged"
    charged = sum(r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] for r in admitted)
    budget = BUDGET if tier == "daily" else BUDGET + BUDGET / 60 * elapsed
    assert charged <= budget, f"{len(admitted)} requests were sent {charged} tokens, over the budget of {budget:.0f}"
