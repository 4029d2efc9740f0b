"""UsageEvent: JSON round trip, UTC times, the billing day, and bad input refused with a ValueError naming it."""

from __future__ import annotations

import json
import re
from datetime import UTC, date, datetime, timedelta, timezone

import pytest

from tests.metering.helpers import START, event
from tokenfleet.metering import UsageEvent


def test_json_round_trip():
    original = event(7, ttft_s=None, status="cancelled", replica="", route="")
    assert UsageEvent.from_json(original.to_json()) == original
    assert UsageEvent.from_json(original.to_json().encode()) == original
    assert json.loads(original.to_json())["started_at"] == "2026-03-01T23:59:58+00:00"


def test_times_are_stored_as_utc_and_the_day_is_the_end_in_utc():
    plus_two = timezone(timedelta(hours=2))
    e = event(
        started_at=datetime(2026, 3, 2, 1, 59, 0, tzinfo=plus_two),
        ended_at=datetime(2026, 3, 2, 2, 0, 30, tzinfo=plus_two),
    )
    assert e.started_at.tzinfo == UTC and e.started_at.hour == 23
    assert e.day == date(2026, 3, 2)  # 00:00:30 UTC
    assert event().day == date(2026, 3, 1)  # 23:59:58 + 1.5 s
    assert event(ended_at=START + timedelta(seconds=2)).day == date(2026, 3, 2)  # billed on the day it ended


def test_events_are_immutable():
    with pytest.raises(AttributeError):
        event().output_tokens = 5


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"input_tokens": -1}, "input_tokens must be a non-negative integer"),
        ({"output_tokens": 1.5}, "output_tokens must be a non-negative integer"),
        ({"cached_tokens": True}, "cached_tokens must be a non-negative integer"),
        ({"input_tokens": 10, "cached_tokens": 11}, "cached_tokens (11) exceeds input_tokens (10)"),
        ({"status": "done"}, "status must be one of finished, cancelled, failed"),
        ({"request_id": ""}, "request_id must not be empty"),
        ({"org_id": None}, "org_id must be a string"),
        ({"model": "m" * 201}, "model is longer than 200 characters"),
        ({"latency_s": -0.1}, "latency_s must be a finite number"),
        ({"latency_s": float("nan")}, "latency_s must be a finite number"),
        ({"ttft_s": float("inf")}, "ttft_s must be a finite number"),
        ({"started_at": datetime(2026, 3, 1)}, "started_at must be timezone-aware"),
        ({"ended_at": "2026-03-01T00:00:00+00:00"}, "ended_at must be a datetime"),
        ({"ended_at": START - timedelta(seconds=1)}, "is before started_at"),
    ],
)
def test_invalid_events_are_refused(overrides, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        event(**overrides)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("not json", "a usage event must be JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"request_id": "r"}', "missing ["),
        (json.dumps({**event().to_dict(), "extra": 1}), "unknown ['extra']"),
        (json.dumps({**event().to_dict(), "ended_at": "yesterday"}), "ended_at is not an ISO 8601 time"),
        (json.dumps({**event().to_dict(), "ended_at": 17}), "ended_at must be an ISO 8601 string"),
        (json.dumps({**event().to_dict(), "input_tokens": "100"}), "input_tokens must be a non-negative integer"),
    ],
)
def test_bad_json_is_refused(text, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        UsageEvent.from_json(text)
