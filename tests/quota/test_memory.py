"""Memory backend specifics, with a clock the test moves: the UTC day rolls over, idle scopes are forgotten."""

from __future__ import annotations

import pytest

from tests.quota.helpers import org, run
from tokenfleet.quota import MemoryQuota
from tokenfleet.quota.rules import day_name, day_number

MIDNIGHT = 1_700_006_400.0  # a UTC midnight (divisible by 86400)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_daily_budget_starts_over_at_utc_midnight_and_old_days_are_left_alone():
    async def main():
        clock = Clock(MIDNIGHT - 1)
        quota = MemoryQuota(clock=clock)
        scope = org(tokens_per_day=1000)
        late = await quota.reserve("late", [scope], 900)
        assert late.reservation.day == "2023-11-14"
        assert (await quota.reserve("r1", [scope], 200)).reason == "tokens_per_day"
        clock.now = MIDNIGHT + 1
        assert (await quota.remaining(scope)).tokens_today == 1000
        await quota.reconcile(late.reservation, 1900)  # yesterday's shortfall does not eat today's budget
        assert (await quota.remaining(scope)).tokens_today == 1000
        assert (await quota.reserve("r2", [scope], 1000)).allowed

    run(main())


def test_idle_scopes_are_forgotten_but_not_before_they_would_read_the_same():
    async def main():
        clock = Clock(MIDNIGHT + 100)
        quota = MemoryQuota(clock=clock, sweep_interval_s=1)
        minute, daily = org("a", tokens_per_minute=600), org("b", tokens_per_day=1000)
        await quota.reserve("r0", [minute], 300)  # full again 30 s later
        await quota.reserve("r1", [daily], 300)  # counts until midnight
        clock.now += 31
        await quota.reserve("tick", [org("c")], 1)
        assert "org:a" not in quota._scopes and "org:b" in quota._scopes
        assert (await quota.remaining(daily)).tokens_today == 700
        clock.now = MIDNIGHT + 86400 + 5
        await quota.reserve("tick2", [org("c")], 1)
        assert "org:b" not in quota._scopes

    run(main())


def test_day_names_round_trip_and_a_bad_name_is_refused():
    for day in (0, 19_675, 20_422, 2_932_896):  # 1970-01-01 .. 9999-12-31
        assert day_number(day_name(day)) == day
    assert day_name(19_675) == "2023-11-14" and day_name(0) == "1970-01-01"
    with pytest.raises(ValueError):
        day_number("2023-13-01")
