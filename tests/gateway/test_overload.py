"""The degradation ladder under a synthetic overload, end to end: one slot, a slow projected prefill rate, paid
streams queueing up. The ladder climbs one step at a time in the fixed order (batch paused, free capped, free
shed, paid queued), the openai SDK gets 429s it retries, and everything steps back down when the load is gone."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.gateway.conftest import ADMIN_KEY, MODEL, Platform, serving_with_auth
from tests.servers import metric

OVERLOAD = {
    "admin_key": ADMIN_KEY,
    "dispatch": {"slots_per_replica": 1, "load_interval_s": 0.1, "prefill_tokens_per_s": 100},
    "overload": {"ttft_target_s": 1.0, "cool_down_s": 0.3, "shed_retry_after_s": 1, "free_max_tokens": 8},
}


@pytest.fixture(scope="module")
def crowded(demo_model_dir, tmp_path_factory):
    with serving_with_auth(demo_model_dir, tmp_path_factory.mktemp("overload"), OVERLOAD) as platform:
        platform.keys = {tier: platform.new_key(f"{tier}-org", "u", tier) for tier in ("paid", "free", "batch")}
        yield platform


def client(platform: Platform, tier: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{platform.base}/v1", api_key=platform.keys[tier], max_retries=retries, timeout=120)


def ask(c: openai.OpenAI, max_tokens: int):
    return c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Go on"}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def wait_for_level(platform: Platform, level: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(platform.base, "tokenfleet_overload_level") != level:
        assert time.monotonic() < deadline, f"overload level never reached {level}"
        time.sleep(0.05)


def test_the_ladder_fires_in_order_and_recovers(crowded):
    pool = ThreadPoolExecutor(12)
    paid = [pool.submit(ask, client(crowded, "paid"), 400) for _ in range(8)]  # a queue that lasts seconds
    wait_for_level(crowded, 4)
    with pytest.raises(openai.RateLimitError) as shed:
        ask(client(crowded, "free"), 4)
    assert shed.value.response.headers["retry-after"] == "1"
    assert shed.value.body["code"] == "high_demand"
    batch = pool.submit(ask, client(crowded, "batch"), 4)  # queued: the batch tier is paused
    time.sleep(0.3)
    assert not batch.done() and metric(crowded.base, "tokenfleet_dispatch_tier_paused", tier="batch") == 1
    free = pool.submit(ask, client(crowded, "free", retries=30), 50)  # the SDK retries the 429s by itself
    late_paid = pool.submit(ask, client(crowded, "paid"), 3)  # at the top of the ladder paid still only queues
    assert all(f.result(timeout=120).usage.completion_tokens == 400 for f in paid), "paid is never shed"
    assert late_paid.result(timeout=120).usage.completion_tokens == 3
    assert free.result(timeout=120).usage.completion_tokens in (8, 50), "free capped at level 2, or served whole"
    assert batch.result(timeout=120).usage.completion_tokens == 4, "batch runs once the pause lifts"
    wait_for_level(crowded, 0)
    assert metric(crowded.base, "tokenfleet_overload_shed_total", tier="free") >= 2
    assert metric(crowded.base, "tokenfleet_overload_shed_total", tier="paid") == 0
    moves = [tuple(map(int, m)) for m in re.findall(r"overload level (\d) -> (\d)", crowded.log.read_text())]
    climb = moves[:4]
    assert climb == [(0, 1), (1, 2), (2, 3), (3, 4)], moves
    assert all(abs(a - b) == 1 for a, b in moves), "one step at a time"
    assert moves[-1][1] == 0
    pool.shutdown()
