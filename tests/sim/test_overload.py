"""The overload ladder in a simulated launch-day spike: batch paused first, free requests capped then shed, paid
ones only delayed, and the ladder back at level 0 after the spike although batch work keeps arriving."""

from __future__ import annotations

import pytest

from tokenfleet.dispatch.tickets import DispatchSnapshot, TierSnapshot
from tokenfleet.sim import config
from tokenfleet.sim.fleet import Fleet
from tokenfleet.sim.timeline import Sampler, TimelineMetrics, fleet_gauges

SPIKE = (100.0, 60.0)  # at, for how long
RAW = {
    "seed": 4,
    "duration_s": 300,
    "warmup_s": 0,
    "drain_s": 120,
    "fleet": {
        "replicas": 2,
        "gpu": "h100",
        "tensor_parallel": 1,
        "model": "llama-8b",
        "weight_dtype": "fp16",
        "cost": {
            "overhead_s": 0.002,
            "per_sequence_s": 1e-5,
            "per_token_s": 2.5e-4,
            "per_attention_pair_s": 0.0,
            "weights_s": 0.02,
            "per_kv_token_s": 1e-8,
        },
    },
    "workload": {
        "rate": 4,
        "think_time_s": 5,
        "output_tokens_mean": 200,
        "bursts": [{"at_s": SPIKE[0], "duration_s": SPIKE[1], "multiplier": 4}],
    },
    "gateway": {"quota": False},
}


def _snapshot(paused: bool) -> DispatchSnapshot:
    tier = TierSnapshot(
        queued=3,
        queued_tokens=6000,
        oldest_wait_s=1.0,
        paused=paused,
        dispatched=0,
        dispatched_tokens=0,
        wait_s_total=0.0,
        cancelled=0,
    )
    paid = TierSnapshot(2, 500, 0.5, False, 0, 0, 0.0, 0)
    return DispatchSnapshot(slots=4, in_use=4, queued=5, queued_tokens=6500, tiers={"batch": tier, "paid": paid})


def test_a_paused_tiers_queue_is_not_waiting_ahead_of_anyone() -> None:
    assert _snapshot(paused=True).served_queued_tokens == 500
    assert _snapshot(paused=False).served_queued_tokens == 6500


@pytest.fixture(scope="module")
def spike():
    setup = config.parse(RAW)
    fleet = Fleet(setup)
    fleet.metrics = TimelineMetrics(setup.slo, 0.0, bin_s=20)
    sampler = Sampler(fleet.events, 5.0, lambda: fleet_gauges(fleet), fleet.end_s)
    fleet.run()
    return fleet, sampler.samples


def test_the_ladder_climbs_in_the_spike_and_comes_back_down_after_it(spike) -> None:
    fleet, samples = spike
    during = [s["level"] for s in samples if SPIKE[0] <= s["t"] < sum(SPIKE)]
    after = [s["level"] for s in samples if s["t"] >= sum(SPIKE) + 60 and s["t"] < RAW["duration_s"]]
    before = [s["level"] for s in samples if s["t"] < SPIKE[0]]
    assert max(during) >= 3 and max(before) <= 1
    assert after[-1] == 0  # batch still arrives, paused while the ladder is up: its queue does not hold it there


def test_free_is_shed_paid_and_enterprise_never_are(spike) -> None:
    fleet, _ = spike
    tiers = fleet.metrics.tiers
    assert tiers["free"].shed > 0
    assert tiers["paid"].shed == tiers["enterprise"].shed == tiers["batch"].shed == 0
    assert tiers["batch"].delayed > 0  # paused: it waits in the fair queue
    assert fleet.in_flight == 0 and fleet.gateway.queued == 0  # everything admitted ran to the end
