"""The policy with an injected clock: up at once under a load step (bounded by max), ahead of a known daily ramp by
the cold start in forecast mode, down only after the delay, the cool-down and the drain, no flapping on noise,
capacity shifted between pools under a budget, the batch tier only in the trough."""

from __future__ import annotations

import random

import pytest

from tests.autoscale.toy import ToyPool, run
from tokenfleet.autoscale import (
    Autoscaler,
    AutoscaleSettings,
    CurveForecast,
    PoolPolicy,
    PoolSignals,
    ReplicaSignals,
    allocate,
    victims,
)
from tokenfleet.autoscale.policy import Decision, batch_gate

HOUR = 3600.0


def settings(**overrides) -> AutoscaleSettings:
    base = dict(
        mode="reactive",
        cold_start_s=300,
        scale_down_delay_s=60,
        cooldown_s=30,
        drain_settle_s=5,
        pools={"chat": PoolPolicy(min_replicas=1, max_replicas=4, target_in_flight=10)},
    )
    return AutoscaleSettings(**{**base, **overrides})


def replicas(*busy: int, draining: tuple[int, ...] = ()) -> list[ReplicaSignals]:
    return [ReplicaSignals(f"r{i}", i in draining, running=b, started_at=float(i)) for i, b in enumerate(busy)]


def decide(policy: Autoscaler, now: float, **signals):
    return policy.decide(now, {"chat": PoolSignals("chat", **signals)})["chat"]


def test_a_load_step_scales_up_at_once_bounded_by_max():
    policy = Autoscaler(settings())
    d = decide(policy, 0, ready=1, in_flight=10, replicas=replicas(10))
    assert d.desired == 1 and d.start == 0 and d.reason.startswith("hold 1")
    d = decide(policy, 10, ready=1, in_flight=10, queued_requests=40, replicas=replicas(10))
    assert d.desired == 4 and d.start == 3, "50 requests at 10 a replica want 5: capped at max_replicas"
    assert d.reason.startswith("up 1 -> 4: in_flight needs 5.00 replicas")
    d = decide(policy, 20, ready=1, starting=3, in_flight=10, queued_requests=40, replicas=replicas(10))
    assert d.desired == 4 and d.start == 0, "replicas already starting are not started again"


@pytest.mark.parametrize(
    "signal, expected",
    [
        (dict(kv_usage_mean=0.8, in_flight=4), 2),  # 2 replicas at 80% KV: on target
        (dict(kv_usage_mean=0.95, in_flight=4), 3),  # above it: 2 x 0.95 / 0.8 = 2.4
        (dict(projected_ttft_s=3.0, in_flight=4), 4),  # TTFT 3x its 1 s target: 2 x 3 = 6, capped at 4
        (dict(projected_ttft_s=float("inf"), in_flight=4), 4),
    ],
)
def test_kv_usage_and_projected_ttft_drive_the_need_too(signal, expected):
    d = decide(Autoscaler(settings()), 0, ready=2, replicas=replicas(2, 2), **signal)
    assert d.desired == expected, d.reason


def test_batch_work_does_not_make_the_pool_grow():
    policy = Autoscaler(settings())
    d = decide(policy, 0, ready=1, in_flight=30, batch_in_flight=28, kv_usage_mean=0.9, replicas=replicas(30))
    assert d.desired == 1, d.reason


def test_batch_prompts_waiting_on_the_replicas_do_not_make_the_pool_grow():
    """The projected TTFT counts every prompt queued on the replicas: its need is taken at the interactive share of
    the requests in flight, as KV usage's is."""
    interactive = decide(
        Autoscaler(settings()), 0, ready=2, in_flight=10, projected_ttft_s=2.0, replicas=replicas(5, 5)
    )
    assert interactive.desired == 4 and "ttft needs 4.00" in interactive.reason
    mostly_batch = decide(
        Autoscaler(settings()),
        0,
        ready=2,
        in_flight=10,
        batch_in_flight=8,
        projected_ttft_s=2.0,
        replicas=replicas(5, 5),
    )
    assert mostly_batch.desired == 2 and mostly_batch.need == pytest.approx(2 * 2.0 * 0.2), mostly_batch.reason


def test_in_the_trough_the_batch_tier_is_paced_to_the_spare_replicas_prefill_rate():
    policy = Autoscaler(settings())  # cooldown_s 30: the trough must last that long
    quiet = dict(ready=4, in_flight=10, replicas=replicas(3, 3, 2, 2), prefill_tokens_per_s=4000.0)
    d = decide(policy, 0, **quiet)
    assert not d.batch_allowed and d.batch_tokens_per_s == 0 and d.spare_replicas == pytest.approx(3.0)
    d = decide(policy, 30, **quiet)
    assert d.batch_allowed and d.batch_tokens_per_s == pytest.approx(3.0 * 4000.0), "need 1 of 4: 3 spare"
    d = decide(policy, 40, **{**quiet, "in_flight": 30})
    assert not d.batch_allowed and d.batch_tokens_per_s == 0, "need 3 of 4 is no trough"


def test_the_batch_gate_of_a_model_is_its_pools_paces_together_and_closed_if_one_is():
    signals = {key: PoolSignals(key, model="chat", region=key[5:]) for key in ("chat/eu", "chat/us")}
    signals["code"] = PoolSignals("code")
    open_ = {
        "chat/eu": Decision("chat/eu", 2, "", batch_allowed=True, batch_tokens_per_s=1000.0),
        "chat/us": Decision("chat/us", 2, "", batch_allowed=True, batch_tokens_per_s=500.0),
        "code": Decision("code", 1, ""),
    }
    assert batch_gate(signals, open_) == {"chat": 1500.0, "code": 0.0}
    one_busy = {**open_, "chat/us": Decision("chat/us", 3, "")}
    assert batch_gate(signals, one_busy) == {"chat": 0.0, "code": 0.0}


def test_quiet_scales_down_only_after_the_delay_the_cool_down_and_the_drain():
    policy = Autoscaler(settings())
    d = decide(policy, 0, ready=3, in_flight=27, replicas=replicas(9, 9, 9))
    assert d.desired == 3
    for t in range(10, 70, 10):  # quiet since t=10, but not for scale_down_delay_s (60 s) yet
        d = decide(policy, t, ready=3, in_flight=2, replicas=replicas(1, 0, 1))
        assert d.desired == 3 and not d.drain, d.reason
    d = decide(policy, 70, ready=3, in_flight=2, replicas=replicas(1, 0, 1))
    assert d.desired == 2 and d.drain == ["r1"], "the least busy replica is drained, one step at a time"
    assert d.reason.startswith("down 3 -> 2")
    # r1 still finishes a request: it stays (draining, not removed), and no second step before the cool-down
    for t in (80, 90):
        d = decide(policy, t, ready=2, draining=1, in_flight=3, replicas=replicas(1, 1, 1, draining=(1,)))
        assert d.desired == 2 and d.remove == [] and d.drain == [], d.reason
    d = decide(policy, 100, ready=2, draining=1, in_flight=2, replicas=replicas(1, 0, 1, draining=(1,)))
    assert d.remove == ["r1"] and d.desired == 1 and d.drain == ["r2"], "empty: removed; cool-down over: next step"
    d = decide(
        policy,
        110,
        ready=1,
        draining=1,
        in_flight=1,
        replicas=replicas(1) + [ReplicaSignals("r2", True, running=0, started_at=2.0)],
    )
    assert d.remove == ["r2"] and d.desired == 1, "never below min_replicas"


def test_a_drained_replica_is_removed_only_after_settling_and_a_stuck_one_after_max_drain():
    policy = Autoscaler(settings(max_drain_s=100, scale_down_delay_s=0, cooldown_s=0))
    d = decide(policy, 0, ready=2, in_flight=1, replicas=replicas(1, 0))
    assert d.drain == ["r1"]
    d = decide(policy, 1, ready=1, draining=1, in_flight=1, replicas=replicas(1, 0, draining=(1,)))
    assert d.remove == [], "drain_settle_s: the next load report may still show the last request"
    d = decide(policy, 5, ready=1, draining=1, in_flight=1, replicas=replicas(1, 0, draining=(1,)))
    assert d.remove == ["r1"]
    others = [ReplicaSignals("a", running=5), ReplicaSignals("b", True, running=0)]
    d = decide(Autoscaler(settings(scale_down_delay_s=0)), 0, ready=1, draining=1, in_flight=5, replicas=others)
    assert d.remove == [], "a replica someone else drained (an operator) is not this policy's to remove"


def test_a_stuck_drain_ends_after_max_drain_s():
    policy = Autoscaler(settings(max_drain_s=100, scale_down_delay_s=0, cooldown_s=0))
    decide(policy, 0, ready=2, in_flight=3, replicas=replicas(1, 2))
    assert decide(policy, 99, ready=1, in_flight=3, replicas=replicas(1, 2, draining=(0,))).remove == []
    assert decide(policy, 100, ready=1, in_flight=3, replicas=replicas(1, 2, draining=(0,))).remove == ["r0"]


def test_victims_are_the_least_busy_then_the_newest_and_only_removable_ones():
    pool = [
        ReplicaSignals("old", running=0, started_at=1),
        ReplicaSignals("new", running=0, started_at=5),
        ReplicaSignals("busy", running=4, started_at=9),
        ReplicaSignals("configured", removable=False),
        ReplicaSignals("ejected", healthy=False, started_at=10),
    ]
    assert [r.name for r in victims(pool, 4)] == ["new", "old", "busy"]


def test_load_coming_back_puts_a_draining_replica_back_before_starting_a_new_one():
    policy = Autoscaler(settings(scale_down_delay_s=0, cooldown_s=0))
    d = decide(policy, 0, ready=2, in_flight=5, replicas=replicas(3, 2))
    assert d.drain == ["r1"]
    d = decide(policy, 1, ready=1, draining=1, in_flight=25, replicas=replicas(10, 2, draining=(1,)))
    assert d.desired == 3 and d.undrain == ["r1"] and d.start == 1 and d.remove == []


def test_a_removed_replica_still_listed_is_never_put_back():
    policy = Autoscaler(settings(scale_down_delay_s=0, cooldown_s=0, drain_settle_s=0))
    assert decide(policy, 0, ready=2, in_flight=1, replicas=replicas(1, 0)).drain == ["r1"]
    assert decide(policy, 1, ready=1, draining=1, in_flight=1, replicas=replicas(1, 0, draining=(1,))).remove == ["r1"]
    d = decide(policy, 2, ready=1, draining=1, in_flight=30, replicas=replicas(10, 0, draining=(1,)))
    assert d.undrain == [] and d.remove == [] and d.start == 2, "its process is being stopped: start new ones"


def test_one_quiet_sample_after_a_gap_is_not_a_quiet_delay():
    """The delay is measured in time, not over the samples kept: busy until t=600, then no step ran until t=910.
    That the pool was quiet for the 300 s before t=910 is not known, so one quiet sample shrinks nothing."""
    policy = Autoscaler(settings(scale_down_delay_s=300))
    for t in range(0, 610, 10):
        assert decide(policy, t, ready=3, in_flight=27, replicas=replicas(9, 9, 9)).desired == 3
    quiet = dict(ready=3, in_flight=2, replicas=replicas(1, 0, 1))
    d = decide(policy, 910, **quiet)
    assert d.desired == 3 and not d.drain, d.reason
    for t in range(920, 1210, 10):
        assert decide(policy, t, **quiet).desired == 3
    d = decide(policy, 1210, **quiet)
    assert d.desired == 2 and d.reason.startswith("down 3 -> 2"), "quiet from t=910 for the whole 300 s"


def test_a_restarted_gateway_adopts_the_replicas_it_finds_and_shrinks_them_gradually():
    """Its first decision may come before the replica registry is read (ready 0, target min_replicas). The 8
    replicas found on the next step are the target then: down to the need only through the delay and the steps,
    not 8 -> 4 at once."""
    pools = {"chat": PoolPolicy(min_replicas=1, max_replicas=10, target_in_flight=10)}
    policy = Autoscaler(settings(pools=pools))  # scale_down_delay_s 60, cooldown_s 30
    assert decide(policy, 0, ready=0).desired == 1
    found = dict(ready=8, in_flight=34, replicas=replicas(*[4] * 7, 6))  # needs 3.4 replicas
    for t in range(10, 60, 10):
        d = decide(policy, t, **found)
        assert d.desired == 8 and not d.drain, d.reason
    d = decide(policy, 60, **found)
    assert d.desired == 7 and len(d.drain) == 1 and d.reason.startswith("down 8 -> 7"), d.reason


def test_noisy_signals_do_not_flap():
    policy = Autoscaler(settings(pools={"chat": PoolPolicy(min_replicas=1, max_replicas=8, target_in_flight=10)}))
    rng, changes, last = random.Random(7), 0, None
    for t in range(0, 3600, 5):  # demand wanders around 30 requests (3 replicas' worth), +-20%
        demand = int(30 * rng.uniform(0.8, 1.2))
        d = decide(
            policy,
            t,
            ready=3,
            in_flight=min(demand, 30),
            queued_requests=max(0, demand - 30),
            replicas=replicas(*[min(demand, 30) // 3] * 3),
        )
        changes += last is not None and d.desired != last
        last = d.desired
    assert changes <= 1, f"desired replicas changed {changes} times in an hour of noise"


def test_forecast_mode_scales_ahead_of_a_known_daily_ramp_by_the_cold_start():
    curve = CurveForecast([(0, 10), (11.99, 10), (12, 60), (18, 60), (18.1, 10)])  # 10 -> 60 req/s at noon
    pools = {"chat": PoolPolicy(min_replicas=1, max_replicas=10, target_in_flight=10, replica_rps=10)}
    forecast = Autoscaler(settings(mode="forecast", warm_buffer=0.0, pools=pools), {"chat": curve})
    reactive = Autoscaler(settings(mode="reactive", pools=pools), {"chat": curve})
    ramp = 12 * HOUR
    early = ramp - 300  # a cold start before the ramp
    for policy in (forecast, reactive):
        for t in (early - 60, early - 40):
            assert decide(policy, t, ready=1, in_flight=10, arrival_rate=10, replicas=replicas(10)).desired == 1
    d = decide(forecast, early, ready=1, in_flight=10, arrival_rate=10, replicas=replicas(10))
    assert d.desired == 6 and d.start == 5 and "forecast needs 6.00" in d.reason and d.forecast_rps == 60
    assert decide(reactive, early, ready=1, in_flight=10, arrival_rate=10, replicas=replicas(10)).desired == 1


def test_forecast_and_warm_buffer_beat_reactive_over_a_ramp_with_slow_cold_starts():
    def demand(t: float) -> float:  # 10 -> 60 requests in flight between 9:00 and 10:00, back down by 20:00
        hour = t / HOUR
        return 10 + 50 * min(1.0, max(0.0, hour - 9)) - 50 * min(1.0, max(0.0, hour - 19))

    curve = CurveForecast([(0, 10), (9, 10), (10, 60), (19, 60), (20, 10)])
    pools = {"chat": PoolPolicy(min_replicas=1, max_replicas=10, target_in_flight=10, replica_rps=10)}
    outcome = {}
    for mode in ("forecast", "reactive"):
        policy, pool = (
            Autoscaler(settings(mode=mode, cold_start_s=900, pools=pools), {"chat": curve}),
            ToyPool("chat", cold_start_s=900),
        )
        pool.add(0)
        queued = replica_seconds = 0.0
        for _, signals, _ in run(policy, pool, demand, 6 * HOUR, 22 * HOUR, step=30):
            queued += signals.queued_requests * 30
            replica_seconds += (signals.ready + signals.starting + signals.draining) * 30
        outcome[mode] = (queued, replica_seconds / HOUR)
    assert outcome["forecast"][0] == 0, "nothing waited for a replica: they were warm before the ramp"
    assert outcome["reactive"][0] > 10_000, "reactive: requests waited through every cold start"
    assert outcome["forecast"][1] < 1.5 * outcome["reactive"][1], "the warm buffer costs GPU-hours, not many"


def test_reactive_mode_ignores_the_forecast_and_the_buffer():
    pools = {"chat": PoolPolicy(min_replicas=1, max_replicas=10, target_in_flight=10, replica_rps=10)}
    policy = Autoscaler(settings(mode="reactive", pools=pools), {"chat": CurveForecast([(0, 90)])})
    d = decide(policy, 0, ready=2, in_flight=20, arrival_rate=90, replicas=replicas(10, 10))
    assert d.desired == 2 and d.forecast_rps is None


def test_the_warm_buffer_keeps_capacity_above_the_need():
    pools = {"chat": PoolPolicy(min_replicas=1, max_replicas=20, target_in_flight=10, replica_rps=10)}
    policy = Autoscaler(settings(mode="forecast", warm_buffer=0.25, pools=pools), {"chat": CurveForecast([(0, 80)])})
    d = decide(policy, 0, ready=8, in_flight=80, arrival_rate=80, replicas=replicas(*[10] * 8))
    assert d.need == 8 and d.desired == 10


def test_capacity_shifts_between_pools_under_a_budget_by_priority():
    pools = {
        "chat": PoolPolicy(min_replicas=1, max_replicas=6, target_in_flight=10, priority=0),
        "code": PoolPolicy(min_replicas=1, max_replicas=6, target_in_flight=10, priority=1),
    }
    policy = Autoscaler(settings(budget=4, pools=pools, scale_down_delay_s=0, cooldown_s=0))
    chat, code = ToyPool("chat", cold_start_s=0), ToyPool("code", cold_start_s=0)
    chat.add(0)
    for _ in range(3):
        code.add(0)
    signals = {"chat": chat.signals(0, 10), "code": code.signals(0, 30)}
    d = policy.decide(0, signals)
    assert (d["chat"].desired, d["code"].desired) == (1, 3)
    signals = {"chat": chat.signals(10, 50), "code": code.signals(10, 30)}  # chat surges
    d = policy.decide(10, signals)
    assert (d["chat"].desired, d["code"].desired) == (3, 1), "chat goes first; code keeps its minimum"
    assert d["code"].reason.endswith("budget 4 allows 1") and len(d["code"].drain) == 2
    assert d["chat"].start == 0, "no room in the budget until code's replicas are gone"
    for pool in (chat, code):
        pool.apply(10, d[pool.name])
    code.finish_drained()
    d = policy.decide(20, {"chat": chat.signals(20, 50), "code": code.signals(20, 30)})
    assert len(d["code"].remove) == 2 and d["chat"].start == 0
    for pool in (chat, code):
        pool.apply(20, d[pool.name])
    d = policy.decide(30, {"chat": chat.signals(30, 50), "code": code.signals(30, 30)})
    assert d["chat"].start == 2 and d["code"].desired == 1


def test_allocate_splits_a_priority_class_evenly():
    pools = {n: PoolPolicy(min_replicas=1, max_replicas=10, priority=p) for n, p in (("a", 0), ("b", 0), ("c", 1))}
    assert allocate({"a": 6, "b": 6, "c": 4}, pools, 9) == {"a": 4, "b": 4, "c": 1}
    assert allocate({"a": 2, "b": 6, "c": 4}, pools, 9) == {"a": 2, "b": 6, "c": 1}
    assert allocate({"a": 2, "b": 2, "c": 4}, pools, 9) == {"a": 2, "b": 2, "c": 4}
    assert allocate({"a": 2, "b": 2, "c": 4}, pools, None) == {"a": 2, "b": 2, "c": 4}


def test_the_batch_tier_runs_only_in_the_trough():
    curve = CurveForecast([(0, 8), (6, 8), (9, 50), (18, 50), (21, 8)])  # requests/s, 1 s each
    pools = {"chat": PoolPolicy(min_replicas=2, max_replicas=10, target_in_flight=10, replica_rps=10)}
    policy = Autoscaler(settings(mode="forecast", cold_start_s=900, pools=pools), {"chat": curve})
    pool = ToyPool("chat", cold_start_s=900)
    pool.add(0)
    pool.add(0)
    allowed = {}
    for t, signals, d in run(policy, pool, lambda t: curve.rate(t), 0, 24 * HOUR, step=60):
        allowed.setdefault(int(t // HOUR), []).append(d.batch_allowed)
        if d.batch_allowed:
            assert d.desired <= signals.ready and d.spare_replicas > 0
    assert all(allowed[h][-1] for h in (1, 2, 3, 4, 23)), "night: batch fills the idle replicas"
    assert not any(any(allowed[h]) for h in range(6, 21)), (
        "from the morning ramp (less a cold start) to the evening: interactive only"
    )


def test_decisions_are_deterministic():
    def day(policy):
        pool = ToyPool("chat", cold_start_s=600)
        pool.add(0)
        rng = random.Random(3)
        return [
            (d.desired, d.start, d.drain, d.remove, d.batch_allowed, d.reason)
            for _, _, d in run(policy, pool, lambda t: rng.uniform(0, 60), 0, 6 * HOUR, step=60)
        ]

    pools = {"chat": PoolPolicy(min_replicas=1, max_replicas=10, target_in_flight=10, replica_rps=10)}
    curve = CurveForecast([(0, 5), (3, 40)])
    assert day(Autoscaler(settings(mode="forecast", pools=pools), {"chat": curve})) == day(
        Autoscaler(settings(mode="forecast", pools=pools), {"chat": curve})
    )
