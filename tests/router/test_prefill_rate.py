"""The prefill rate that projects time to first token is measured from the replicas' load reports, not guessed."""

from __future__ import annotations

import pytest

from tokenfleet.router.load import parse_load_json, parse_prometheus
from tokenfleet.router.replica_state import ReplicaState


def report(state: ReplicaState, total: int, at: float, queued: int) -> None:
    state.reported(running=4, waiting=0, queued_tokens=queued, kv_usage=0.1)
    state.count_prefill(total, at)


def test_rate_is_measured_while_prefill_work_stays_queued():
    state = ReplicaState("r")
    report(state, 0, 10.0, queued=5000)
    assert state.prefill_tokens_per_s == 0.0  # one report measures nothing
    report(state, 9000, 11.0, queued=3000)
    assert state.prefill_tokens_per_s == 9000.0
    report(state, 16000, 12.0, queued=100)
    assert state.prefill_tokens_per_s == pytest.approx((9000 + 7000) / 2)  # smoothed


def test_an_interval_idle_at_either_end_says_nothing_about_the_rate():
    state = ReplicaState("r")
    report(state, 0, 10.0, queued=5000)
    report(state, 9000, 11.0, queued=2000)
    report(state, 9100, 12.0, queued=0)  # drained early in the interval: 100 tokens/s is not its speed
    report(state, 9100, 13.0, queued=800)  # idle at the start of this one
    assert state.prefill_tokens_per_s == 9000.0


def test_a_restarted_replica_does_not_give_a_negative_rate():
    state = ReplicaState("r")
    report(state, 50000, 10.0, queued=5000)
    report(state, 100, 11.0, queued=5000)
    assert state.prefill_tokens_per_s == 0.0
    report(state, 4100, 12.0, queued=5000)
    assert state.prefill_tokens_per_s == 4000.0


def test_load_reports_carry_the_prefilled_count():
    ours = '{"running": 1, "waiting": 0, "queued_prefill_tokens": 0, "kv_usage": 0.0, "prefill_tokens_total": 1234}'
    assert parse_load_json(ours, 1.0).prefill_tokens_total == 1234
    older = '{"running": 1, "waiting": 0, "queued_prefill_tokens": 0, "kv_usage": 0.0}'
    assert parse_load_json(older, 1.0).prefill_tokens_total is None
    vllm = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 3.0
vllm:num_requests_running{engine="1"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} 0.5
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0"} 1000.0
vllm:prompt_tokens_total{engine="1"} 500.0
"""
    assert parse_prometheus(vllm, 1.0).prefill_tokens_total == 1500
    without = vllm.split("# TYPE vllm:prompt_tokens")[0]
    assert parse_prometheus(without, 1.0).prefill_tokens_total is None


def test_a_pools_rate_counts_each_replica_taking_work_as_measured_or_else_as_configured():
    from tokenfleet.router.catalog import ModelCatalog, ModelSpec, PoolSpec
    from tokenfleet.router.load import LoadReport
    from tokenfleet.router.router import Router
    from tokenfleet.router.settings import RoutingSettings

    spec = ModelSpec("m", "/x", pools=[PoolSpec("p", ["http://a", "http://b", "http://c"])])
    router = Router(ModelCatalog([spec]), RoutingSettings(), slots_per_replica=4, make_upstream=lambda u, n, k: u)
    router.add_configured_replicas()
    pools = router.models["m"]
    assert pools.prefill_tokens_per_s(4000.0) == 12000.0  # nothing measured: the configured guess for each
    for total, at in ((0, 1.0), (6000, 2.0)):
        pools.update_load("http://a", LoadReport(2, 3, 900, 0.2, at, prefill_tokens_total=total))
    pools.set_draining("http://c")
    assert pools.taking() == 2
    assert pools.prefill_tokens_per_s(4000.0) == 6000.0 + 4000.0
