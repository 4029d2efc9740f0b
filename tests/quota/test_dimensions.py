"""Each dimension admits up to its limit and refuses after, with the right reason, scope and retry-after; refill;
all-or-nothing; zero limits and requests that can never fit. Runs on both backends."""

from __future__ import annotations

import asyncio
import re
import time

from tests.quota.helpers import opened, org, run, user

RESET = re.compile(r"^(\d+h)?(\d+m)?(\d+(\.\d{1,3})?s|\d+ms)$")


def test_requests_per_minute(backend):
    async def main():
        async with opened(backend) as quota:
            scope = org(requests_per_minute=3)
            for i in range(3):
                assert (await quota.reserve(f"r{i}", [scope], 1)).allowed
            refused = await quota.reserve("r3", [scope], 1)
            assert (refused.allowed, refused.reason, refused.scope) == (False, "requests_per_minute", "org:acme")
            assert 19.0 < refused.retry_after_s <= 20.0  # one request refills in 60/3 s
            assert refused.headers["retry-after"] == "20" and refused.headers["x-ratelimit-remaining-requests"] == "0"

    run(main())


def test_tokens_per_minute(backend):
    async def main():
        async with opened(backend) as quota:
            scope = org(tokens_per_minute=1000)
            for i in range(3):
                assert (await quota.reserve(f"r{i}", [scope], 300)).allowed
            refused = await quota.reserve("r3", [scope], 300)
            assert (refused.reason, refused.scope) == ("tokens_per_minute", "org:acme")
            assert 11.5 < refused.retry_after_s <= 12.0  # 200 missing tokens at 1000/60 per second
            assert (await quota.reserve("r4", [scope], 100)).allowed  # what is left still fits a smaller one

    run(main())


def test_concurrent_requests(backend):
    async def main():
        async with opened(backend, concurrency_retry_s=0.5) as quota:
            scope = user(concurrent_requests=2)
            first = await quota.reserve("r0", [scope], 10)
            assert first.allowed and (await quota.reserve("r1", [scope], 10)).allowed
            refused = await quota.reserve("r2", [scope], 10)
            assert (refused.reason, refused.scope, refused.retry_after_s) == ("concurrent_requests", "user:acme/7", 0.5)
            await quota.reconcile(first.reservation, 10)
            assert (await quota.reserve("r3", [scope], 10)).allowed

    run(main())


def test_tokens_per_day(backend):
    async def main():
        async with opened(backend) as quota:
            scope = org(tokens_per_day=1000)
            assert (await quota.reserve("r0", [scope], 400)).allowed
            assert (await quota.reserve("r1", [scope], 400)).allowed
            refused = await quota.reserve("r2", [scope], 400)
            assert refused.reason == "tokens_per_day"
            assert abs(refused.retry_after_s - (86400 - time.time() % 86400)) < 5  # the next UTC day
            assert (await quota.reserve("r3", [scope], 200)).allowed
            assert (await quota.remaining(scope)).tokens_today == 0

    run(main())


def test_token_bucket_refills_over_time(backend):
    async def main():
        async with opened(backend) as quota:
            scope = org(tokens_per_minute=6000)  # 100 tokens per second
            assert (await quota.reserve("drain", [scope], 6000)).allowed
            refused = await quota.reserve("r0", [scope], 50)
            assert refused.reason == "tokens_per_minute" and 0.4 < refused.retry_after_s <= 0.5
            await asyncio.sleep(0.6)
            assert (await quota.reserve("r1", [scope], 50)).allowed
            assert not (await quota.reserve("r2", [scope], 50)).allowed  # ~10 left, not 50

    run(main())


def test_requests_refill_over_time(backend):
    async def main():
        async with opened(backend) as quota:
            scope = org(requests_per_minute=240)  # 4 per second
            admitted = 0
            while (await quota.reserve(f"r{admitted}", [scope], 0)).allowed:
                admitted += 1
            assert 240 <= admitted <= 242  # the capacity, plus what refilled while the loop ran
            await asyncio.sleep(0.3)
            assert (await quota.reserve("again", [scope], 0)).allowed

    run(main())


def test_all_or_nothing(backend):
    async def main():
        async with opened(backend) as quota:
            acme, seven = (
                org(tokens_per_minute=1000),
                user(requests_per_minute=100, tokens_per_minute=10_000, concurrent_requests=5, tokens_per_day=50_000),
            )
            assert (await quota.reserve("r0", [acme, seven], 900)).allowed
            before = await quota.remaining(seven)
            refused = await quota.reserve("r1", [acme, seven], 500)
            assert (refused.reason, refused.scope) == ("tokens_per_minute", "org:acme")
            after = await quota.remaining(seven)
            assert after.concurrent == before.concurrent == 4 and after.tokens_today == before.tokens_today == 49_100
            assert 0 <= after.tokens - before.tokens < 5 and 0 <= after.requests - before.requests < 1  # refill only
            # and the other way round: a refusal on the user scope leaves the organisation untouched
            small_user = user(number=8, tokens_per_minute=100)
            org_before = await quota.remaining(acme)
            refused = await quota.reserve("r2", [acme, small_user], 100 + 1)
            assert refused.reason == "request_too_large" and refused.scope == "user:acme/8"
            assert 0 <= (await quota.remaining(acme)).tokens - org_before.tokens < 5

    run(main())


def test_zero_limits_refuse_everything(backend):
    async def main():
        async with opened(backend) as quota:
            for dim in ("requests_per_minute", "tokens_per_minute", "concurrent_requests", "tokens_per_day"):
                for tokens in (0, 10):
                    refused = await quota.reserve(f"{dim}-{tokens}", [org(**{dim: 0})], tokens)
                    assert (refused.allowed, refused.reason, refused.retry_after_s) == (False, dim, None)
                    assert "retry-after" not in refused.headers

    run(main())


def test_request_too_large_can_never_fit(backend):
    async def main():
        async with opened(backend) as quota:
            for limits in ({"tokens_per_minute": 1000}, {"tokens_per_day": 1000}):
                scope = org(**limits)
                refused = await quota.reserve("big", [scope], 1001)
                assert (refused.reason, refused.scope, refused.retry_after_s) == ("request_too_large", "org:acme", None)
                assert "retry-after" not in refused.headers
                assert (await quota.reserve("fits", [scope], 1000)).allowed  # nothing was charged

    run(main())


def test_headers_well_formed(backend):
    async def main():
        async with opened(backend) as quota:
            acme = org(requests_per_minute=100, tokens_per_minute=100_000)
            seven = user(requests_per_minute=10, tokens_per_minute=1000, concurrent_requests=10)
            allowed = await quota.reserve("r0", [acme, seven], 400)
            h = allowed.headers
            assert h["x-ratelimit-limit-requests"] == "10" and h["x-ratelimit-remaining-requests"] == "9"
            assert h["x-ratelimit-limit-tokens"] == "1000" and h["x-ratelimit-remaining-tokens"] == "600"
            assert RESET.match(h["x-ratelimit-reset-requests"]) and RESET.match(h["x-ratelimit-reset-tokens"])
            assert "retry-after" not in h
            refused = await quota.reserve("r1", [acme, seven], 700)
            h = refused.headers
            assert set(h) >= {
                "x-ratelimit-limit-requests",
                "x-ratelimit-remaining-requests",
                "x-ratelimit-reset-requests",
                "x-ratelimit-limit-tokens",
                "x-ratelimit-remaining-tokens",
                "x-ratelimit-reset-tokens",
                "retry-after",
                "retry-after-ms",
            }
            assert h["retry-after"] == "6" and 5900 < int(h["retry-after-ms"]) <= 6000  # 100 short at 1000/60 per s
            assert all(RESET.match(h[k]) for k in h if k.startswith("x-ratelimit-reset"))
            unlimited = await quota.reserve("r2", [org(tenant="free")], 10)
            assert unlimited.allowed and unlimited.headers == {}

    run(main())


def test_longest_wait_is_reported(backend):
    async def main():
        async with opened(backend) as quota:
            scope = org(tokens_per_minute=1000, tokens_per_day=1500)
            assert (await quota.reserve("r0", [scope], 1000)).allowed
            refused = await quota.reserve("r1", [scope], 600)  # short on both; the day is the longer wait
            assert refused.reason == "tokens_per_day" and refused.retry_after_s > 36

    run(main())
