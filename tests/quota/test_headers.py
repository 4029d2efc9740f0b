"""The reset format OpenAI uses and the retry-after headers."""

from __future__ import annotations

import pytest

from tokenfleet.quota.headers import BucketView, format_duration, ratelimit_headers


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0, "0s"),
        (0.12, "120ms"),
        (0.0004, "1ms"),
        (0.999, "999ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (17.2345, "17.235s"),
        (60, "1m0s"),
        (360, "6m0s"),
        (83.5, "1m23.5s"),
        (3723, "1h2m3s"),
        (-3, "0s"),
    ],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_tightest_bucket_and_retry_after():
    roomy = BucketView(limit=1000, level=900, capacity=1000, rate=1000 / 60)
    tight = BucketView(limit=100, level=-5.5, capacity=100, rate=100 / 60)
    headers = ratelimit_headers([roomy], [roomy, tight], retry_after_s=2.0001)
    assert headers == {
        "x-ratelimit-limit-requests": "1000",
        "x-ratelimit-remaining-requests": "900",
        "x-ratelimit-reset-requests": "6s",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "1m3.3s",
        "retry-after": "3",
        "retry-after-ms": "2001",
    }
    assert ratelimit_headers([], [], None) == {}
    assert ratelimit_headers([], [], 0.0001) == {"retry-after": "1", "retry-after-ms": "1"}
