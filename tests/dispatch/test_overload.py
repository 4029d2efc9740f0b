"""The overload ladder: projected TTFT, one step at a time up and (with hysteresis) down, and the plan per tier."""

from __future__ import annotations

import asyncio
import logging
import math

import pytest

from tests.dispatch.sim import FakeClock, Grant, settle
from tokenfleet.config import default_tiers
from tokenfleet.dispatch import Dispatcher, LoadSignal, OverloadLadder, OverloadSettings, Plan, Ticket, projected_ttft_s

SETTINGS = OverloadSettings(
    ttft_target_s=1.0,
    thresholds=(0.5, 0.75, 1.0, 1.5),
    step_down_ratio=0.8,
    cool_down_s=10.0,
    free_max_tokens=256,
    free_model="small-8b",
    shed_retry_after_s=7.0,
)


def load(ttft_s: float, rate: float = 10_000.0) -> LoadSignal:
    """A signal whose projected TTFT is ttft_s: the backlog split between the dispatcher and the replicas."""
    backlog = round(ttft_s * rate)
    return LoadSignal(
        queued_tokens=backlog // 2,
        replica_waiting_tokens=backlog - backlog // 2,
        running=8,
        slots=8,
        prefill_tokens_per_s=rate,
    )


def test_projected_ttft():
    assert projected_ttft_s(LoadSignal(3000, 2000, 4, 8, 10_000.0)) == 0.5
    assert projected_ttft_s(LoadSignal(0, 0, 0, 8, 0.0)) == 0.0
    assert projected_ttft_s(LoadSignal(10, 0, 8, 8, 0.0)) == math.inf
    with pytest.raises(ValueError, match="queued_tokens"):
        LoadSignal(-1, 0, 0, 8, 100.0)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        LoadSignal(0, 0, 0, 8, float("nan"))


def test_ramp_up_one_step_at_a_time_and_down_with_hysteresis(caplog):
    clock = FakeClock()
    ladder = OverloadLadder(SETTINGS, clock=clock)
    levels = []
    with caplog.at_level(logging.INFO, logger="tokenfleet.dispatch.overload"):
        for i in range(41):  # projected TTFT 0 -> 2 s over 40 s
            clock.now = float(i)
            levels.append(ladder.update(load(i * 0.05)))
        assert levels[0] == 0 and levels[-1] == 4
        assert all(b - a in (0, 1) for a, b in zip(levels, levels[1:]))
        first = {level: levels.index(level) for level in range(5)}
        assert [first[n] for n in range(5)] == [0, 10, 15, 20, 30]  # 0.5, 0.75, 1.0, 1.5 s

        # just under level 4's threshold but above 80% of it: no step down, however long
        for _ in range(30):
            clock.now += 1
            assert ladder.update(load(1.3)) == 4
        # calm: each step down needs a full cool-down below 80% of that step's threshold
        downs = []
        for _ in range(60):
            clock.now += 1
            downs.append(ladder.update(load(0.0)))
        assert all(a - b in (0, 1) for a, b in zip([4] + downs, downs))
        assert [downs.index(level) for level in (3, 2, 1, 0)] == [10, 21, 32, 43]
    changes = [r.getMessage() for r in caplog.records if "overload level" in r.getMessage()]
    assert len(changes) == 8 and all("projected TTFT" in m for m in changes)
    assert changes[0].startswith("overload level 0 -> 1 (projected TTFT 0.50 s")
    assert [r.levelname for r in caplog.records if "overload level" in r.getMessage()] == ["WARNING"] * 4 + ["INFO"] * 4


def test_a_spike_still_climbs_one_step_per_update():
    ladder = OverloadLadder(SETTINGS, clock=FakeClock())
    assert [ladder.update(load(9.0)) for _ in range(6)] == [1, 2, 3, 4, 4, 4]
    assert ladder.projected_ttft_s == 9.0


def test_a_blip_above_the_mark_restarts_the_cool_down():
    clock = FakeClock()
    ladder = OverloadLadder(SETTINGS, clock=clock)
    ladder.update(load(0.6))
    assert ladder.level == 1
    for t, ttft in [(1, 0.1), (9, 0.1), (10, 0.45), (11, 0.1), (20, 0.1)]:  # 0.45 >= 0.8 * 0.5
        clock.now = t
        assert ladder.update(load(ttft)) == 1
    clock.now = 21
    assert ladder.update(load(0.1)) == 0


def plans(ladder: OverloadLadder) -> dict[str, Plan]:
    return {tier: ladder.plan(tier) for tier in ("enterprise", "paid", "free", "batch")}


def test_plans_per_tier_at_each_level():
    clock = FakeClock()
    ladder = OverloadLadder(SETTINGS, clock=clock)
    admit = Plan("admit", None, None, None, 0)
    assert plans(ladder) == dict.fromkeys(("enterprise", "paid", "free", "batch"), admit)

    expected = {
        1: {
            "paid": ("admit", None, None, None),
            "free": ("admit", None, None, None),
            "batch": ("queue", None, None, None),
        },
        2: {
            "paid": ("admit", None, None, None),
            "free": ("admit", 256, "small-8b", None),
            "batch": ("queue", None, None, None),
        },
        3: {
            "paid": ("admit", None, None, None),
            "free": ("shed", None, None, 7.0),
            "batch": ("queue", None, None, None),
        },
        4: {
            "paid": ("queue", None, None, None),
            "free": ("shed", None, None, 7.0),
            "batch": ("queue", None, None, None),
        },
    }
    for level in range(1, 5):
        ladder.update(load(2.0))
        assert ladder.level == level
        got = plans(ladder)
        assert got["enterprise"] == got["paid"]  # every tier that is neither batch nor free is paid
        for tier, (action, cap, model, retry) in expected[level].items():
            plan = got[tier]
            assert (plan.action, plan.max_tokens_cap, plan.model_override, plan.retry_after_s, plan.level) == (
                action,
                cap,
                model,
                retry,
                level,
            ), (level, tier)
    assert got["paid"].queue_delay_s == 2.0  # at level 4 paid requests queue, told the projected delay

    no_small_model = OverloadLadder(OverloadSettings(free_model=None), clock=clock)
    for _ in range(2):
        no_small_model.update(load(0.8))
    assert no_small_model.plan("free") == Plan("admit", 256, None, None, 2)


def test_apply_pauses_and_resumes_the_batch_tier():
    async def main():
        clock = FakeClock()
        ladder = OverloadLadder(OverloadSettings(cool_down_s=0.0), clock=clock)
        d = Dispatcher(default_tiers(), slots=0, clock=clock)
        batch = asyncio.create_task(d.acquire(Ticket("b", "org", "batch", 10)))
        ladder.update(load(0.6))
        ladder.apply(d)
        d.set_slots(1)
        await settle()
        assert d.snapshot().tiers["batch"].paused and not batch.done()
        ladder.update(load(0.0))
        ladder.update(load(0.0))  # cool-down 0: the second calm reading steps down
        assert ladder.level == 0
        ladder.apply(d)
        await settle()
        assert batch.done() and not d.snapshot().tiers["batch"].paused
        OverloadLadder(OverloadSettings(batch_tiers=("batch", "bulk")), clock=clock).apply(d)  # unknown: skipped

    asyncio.run(main())


def test_apply_paces_the_batch_tier_to_the_batch_gate():
    """The gate's tokens/s are granted over the level-1 threshold of projected TTFT (0.5 s here): 1,000 tokens."""
    clock = FakeClock()
    ladder = OverloadLadder(SETTINGS, clock=clock)
    d = Dispatcher(default_tiers(), slots=10, clock=clock)
    ladder.apply(d, 0.0)
    for i in range(4):
        d.submit(Ticket(f"b{i}", "org", "batch", 600), Grant())
    assert d.snapshot().tiers["batch"].paused and d.snapshot().tiers["batch"].in_use == 0, "closed: nothing goes"
    ladder.apply(d, 2000.0)
    batch = d.snapshot().tiers["batch"]
    assert not batch.paused and batch.in_use == 2 and batch.queued == 2 and batch.at_limit  # 600 < 1,000 <= 1,200
    clock.now = 0.5
    ladder.apply(d, 2000.0)
    assert d.snapshot().tiers["batch"].in_use == 4, "a window later: the rest"
    ladder.update(load(0.6))
    ladder.apply(d, None)
    d.submit(Ticket("b4", "org", "batch", 1), Grant())
    assert d.snapshot().tiers["batch"].paused and d.snapshot().tiers["batch"].queued == 1, "level 1 pauses batch"
    ladder.update(load(0.0))
    ladder.update(load(0.0))
    clock.now = 20.0
    ladder.update(load(0.0))
    assert ladder.level == 0
    ladder.apply(d, None)
    assert d.snapshot().tiers["batch"].in_use == 5, "no gate: no pace"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"thresholds": (0.5, 0.4, 1.0, 1.5)}, "increasing"),
        ({"thresholds": (0.5, 0.75, 0.75, 1.5)}, "increasing"),
        ({"thresholds": (-0.5, 0.75, 1.0, 1.5)}, "positive"),
        ({"thresholds": (0.5, 0.75, 1.0)}, "4 values"),
        ({"ttft_target_s": 0.0}, "ttft_target_s"),
        ({"step_down_ratio": 1.0}, "step_down_ratio"),
        ({"cool_down_s": -1.0}, "cool_down_s"),
        ({"free_max_tokens": 0}, "free_max_tokens"),
        ({"shed_retry_after_s": 0}, "shed_retry_after_s"),
        ({"free_tiers": ("free", "batch")}, "both batch and free"),
    ],
)
def test_bad_settings_raise(changes, message):
    with pytest.raises(ValueError, match=message):
        OverloadSettings(**changes)
