"""Multi-turn chat under the three routing policies, in the fleet simulator (tokenfleet/sim): each replica runs the
engine's real scheduler and KVBlockManager (prefix cache, LRU eviction, on a cache of limited size) with the step
times of a cost model, and the router's real policies choose among them. Deterministic (seeded), in process."""

from __future__ import annotations

from tokenfleet.sim import config
from tokenfleet.sim.fleet import Fleet

BLOCKS_PER_REPLICA = 2000  # 32k tokens of KV per replica; the active conversations need more than one replica's
RAW = {
    "seed": 0,
    "duration_s": 150,
    "warmup_s": 0,
    "drain_s": 120,
    "fleet": {"replicas": 4, "gpu": "h100", "tensor_parallel": 1, "model": "llama-8b", "weight_dtype": "fp16"},
    "engine": {"num_blocks": BLOCKS_PER_REPLICA},
    # three shared system prompts, five turns per conversation on average, a few seconds between turns
    "workload": {
        "rate": 8,
        "system_prompts": 3,
        "turns_mean": 5,
        "think_time_s": 3,
        "cancel_probability": 0,
        "output_tokens_mean": 150,
        "tiers": {"paid": 1},
    },
    "gateway": {"quota": False, "overload": {"ttft_target_s": 1e9}},
}


def _fleet(policy: str, replicas: int = 4, blocks: int = BLOCKS_PER_REPLICA, affinity: bool = False) -> Fleet:
    raw = {
        **RAW,
        "fleet": {**RAW["fleet"], "replicas": replicas},
        "engine": {"num_blocks": blocks},
        "routing": {"policy": policy, "affinity": affinity},
    }
    return Fleet(config.parse(raw))


def _hit_rate(fleet: Fleet) -> float:
    m = fleet.metrics.tiers["paid"]
    return m.cached_tokens / m.prompt_tokens


def _imbalance(replicas) -> float:
    """Max over mean of the time each replica spent computing."""
    busy = [r.busy_s for r in replicas]
    return max(busy) / (sum(busy) / len(busy))


def test_cache_aware_routing_keeps_hits_close_to_one_big_cache_and_stays_balanced() -> None:
    combined = _hit_rate(_fleet("round_robin", replicas=1, blocks=4 * BLOCKS_PER_REPLICA).run())
    fleets = {policy: _fleet(policy).run() for policy in ("cache_aware", "round_robin", "least_loaded")}
    hits = {policy: _hit_rate(f) for policy, f in fleets.items()}
    report = f"one 4x cache: {combined:.3f}; " + ", ".join(f"{p}: {h:.3f}" for p, h in hits.items())
    assert hits["cache_aware"] >= 0.9 * combined, report
    assert _imbalance(fleets["cache_aware"].replicas) <= 1.25, report
    assert hits["round_robin"] <= 0.75 * hits["cache_aware"], report
    assert hits["least_loaded"] <= 0.75 * hits["cache_aware"], report


def test_a_replica_failing_mid_run_gets_no_more_traffic_and_the_rest_stay_balanced() -> None:
    fleet = _fleet("cache_aware", affinity=True)
    failed = fleet.by_name["replica-1"]
    routed_after: list[str] = []
    add = failed.add

    def counting_add(sreq) -> None:
        if fleet.clock.now > 60:
            routed_after.append(sreq.rid)
        add(sreq)

    failed.add = counting_add
    fleet.events.at(60.0, lambda: setattr(failed.state, "healthy", False))  # the router's health check ejects it
    fleet.run()
    assert routed_after == []
    survivors = [r for r in fleet.replicas if r is not failed]
    assert _imbalance(survivors) <= 1.25
    assert _hit_rate(fleet) >= 0.75
