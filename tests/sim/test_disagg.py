"""Separate prefill and decode pools: the first token comes from the prefill pool, the KV cache reaches the decode
replica (found there as prefix hits, not recomputed), its transfer time shows up between the first and second
token, and every request completes once."""

from __future__ import annotations

import json

import pytest
import yaml

from tokenfleet.cli import main
from tokenfleet.sim import config
from tokenfleet.sim.disagg import GB, DisaggFleet, DisaggSpec
from tokenfleet.sim.fleet import Fleet
from tokenfleet.sim.models import model_shape

RAW = {
    "seed": 5,
    "duration_s": 40,
    "warmup_s": 0,
    "drain_s": 120,
    "fleet": {"replicas": 3, "gpu": "h100", "tensor_parallel": 1, "model": "llama-8b", "weight_dtype": "fp16"},
    "workload": {
        "rate": 6,
        "cancel_probability": 0,
        "think_time_s": 3,
        "output_tokens_mean": 100,
        "tiers": {"paid": 0.5, "free": 0.5},
    },
    "gateway": {"quota": False, "overload": {"ttft_target_s": 1e9}},
}
KV = model_shape("llama-8b").kv_bytes_per_token("fp16")


def _run(link_gb_per_s: float) -> DisaggFleet:
    fleet = DisaggFleet(config.parse(RAW), DisaggSpec(1, 2, KV, link_gb_per_s * GB, 1.0, 0.001))
    fleet.run()
    return fleet


def _gap_seconds(fleet) -> float:
    return sum(t.itl.total for t in fleet.metrics.tiers.values())


@pytest.fixture(scope="module")
def runs() -> dict[str, DisaggFleet]:
    return {"fast": _run(50.0), "slow": _run(0.5)}


def test_every_request_completes_once_through_both_pools(runs) -> None:
    fleet = runs["fast"]
    assert fleet.in_flight == 0 and not fleet.flights
    tiers = fleet.metrics.tiers.values()
    assert sum(t.arrived for t in tiers) == sum(t.completed for t in tiers) > 100
    assert fleet.transfers == sum(t.completed for t in tiers)  # every answer was longer than one token
    assert all(r.state.in_flight == 0 and not r.has_work() for r in fleet.replicas)
    assert sum(r.steps for r in fleet.prefill) > 0 and sum(r.steps for r in fleet.decode) > 0


def test_the_decode_replica_finds_the_transferred_kv_instead_of_recomputing_it(runs) -> None:
    fleet = runs["fast"]
    assert fleet.recomputed == 0
    assert fleet.decode_cached_tokens >= 0.95 * fleet.decode_prompt_tokens
    # the blocks are released once the request holds them: nothing is left pinned
    assert all(r.blocks.num_free_blocks == r.blocks.num_blocks for r in fleet.decode)


def test_a_slower_link_adds_its_transfer_time_between_the_first_and_second_token(runs) -> None:
    fast, slow = runs["fast"], runs["slow"]
    extra = slow.transfer_s_total - fast.transfer_s_total
    assert extra > 1.0  # 100x less bandwidth: tens of milliseconds per request
    assert _gap_seconds(slow) - _gap_seconds(fast) >= 0.9 * extra
    ttft = [sum(t.ttft) / len(t.ttft) for t in fast.metrics.tiers.values()]
    ttft_slow = [sum(t.ttft) / len(t.ttft) for t in slow.metrics.tiers.values()]
    assert ttft_slow == pytest.approx(ttft, rel=0.05)  # TTFT ends at the prefill pool, before the transfer


def test_the_same_gpus_as_one_chunked_pool_serve_the_same_requests() -> None:
    chunked = Fleet(config.parse(RAW)).run()
    tiers = chunked.metrics.tiers.values()
    assert sum(t.completed for t in tiers) == sum(t.arrived for t in tiers) > 100


def test_cancellations_are_refused_up_front() -> None:
    raw = {**RAW, "workload": {**RAW["workload"], "cancel_probability": 0.1}}
    with pytest.raises(ValueError, match="cancel"):
        DisaggFleet(config.parse(raw), DisaggSpec(1, 2, KV))


def test_tokenfleet_simulate_runs_the_disaggregated_layout_from_its_config(tmp_path, runs) -> None:
    path = tmp_path / "sim.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                **RAW,
                "disagg": {
                    "prefill_replicas": 1,
                    "decode_replicas": 2,
                    "link_gb_per_s": 50.0,
                    "link_efficiency": 1.0,
                    "transfer_latency_s": 0.001,
                },
            }
        )
    )
    assert main(["simulate", "--config", str(path), "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    fleet = runs["fast"]  # the same spec built in Python: the same run
    assert report["disaggregated"]["transfers"] == fleet.transfers > 100
    assert report["disaggregated"]["prefill_replicas"] == 1 and report["disaggregated"]["decode_replicas"] == 2
    assert report["setup"]["replicas"] == 3
    assert report["totals"]["requests_ended"] == sum(t.completed for t in fleet.metrics.tiers.values())
    assert "KV transfers" in (tmp_path / "out" / "summary.txt").read_text()
