"""Every request the workload sends is counted somewhere: turns too long for max_model_len are refused (as the
gateway's 400), the summary's columns add up to the arrivals, and an autoscaled run keeps the counters of the
replicas it removed."""

from __future__ import annotations

import pytest

from tokenfleet.autoscale.settings import AutoscaleSettings
from tokenfleet.sim import config
from tokenfleet.sim.autoscaling import ScaledFleet, ScalingSetup
from tokenfleet.sim.fleet import Fleet
from tokenfleet.sim.report import build_report, summary

SMALL_MODEL = {
    "params": 8_000_000_000,
    "num_layers": 32,
    "hidden_size": 4096,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "max_model_len": 4096,
}
LONG_BATCH = {
    "seed": 0,
    "duration_s": 60,
    "warmup_s": 0,
    "drain_s": 60,
    "fleet": {"replicas": 1, "gpu": "h100", "tensor_parallel": 1, "weight_dtype": "fp16", "model": SMALL_MODEL},
    "workload": {"rate": 2, "tiers": {"batch": 1}, "batch_prompt_tokens_mean": 8000},
}


def _ended_or_refused(t: dict) -> int:
    return t["completed"] + t["cancelled"] + t["shed"] + t["quota_refused"] + t["rejected"] + t["length_refused"]


def test_a_first_turn_over_max_model_len_arrives_and_is_refused_for_length() -> None:
    fleet = Fleet(config.parse(LONG_BATCH)).run()
    report = build_report(fleet, wall_s=1.0)
    batch = report["tiers"]["batch"]
    started = fleet.workload._next_cid  # one turn per batch conversation
    assert batch["arrived"] == started == fleet.requests_seen == report["totals"]["requests_arrived"]
    assert batch["length_refused"] > started / 2  # most 8,000-token documents do not fit 4,096
    assert batch["arrived"] == _ended_or_refused(batch)
    assert batch["goodput"]["share_of_arrived"] == pytest.approx(
        batch["goodput"]["requests"] / batch["arrived"], abs=1e-4
    )
    assert batch["goodput"]["requests"] <= batch["completed"] < batch["arrived"] / 2
    assert report["totals"]["requests_refused"] == batch["length_refused"]


def test_a_later_turn_over_max_model_len_is_refused_too() -> None:
    raw = {
        **LONG_BATCH,
        "fleet": {**LONG_BATCH["fleet"], "replicas": 2},
        "workload": {"rate": 6, "tiers": {"paid": 1}, "turns_mean": 8, "user_tokens_mean": 600, "think_time_s": 1},
    }
    fleet = Fleet(config.parse(raw)).run()
    paid = build_report(fleet, wall_s=1.0)["tiers"]["paid"]
    assert paid["length_refused"] > 0
    assert paid["arrived"] == fleet.requests_seen == _ended_or_refused(paid)


def test_the_summary_shows_rejected_and_length_refused_and_its_columns_add_up() -> None:
    raw = {
        **LONG_BATCH,
        "engine": {"num_blocks": 256, "watermark": 0.3},  # 2,880 tokens of KV cache to use
        "workload": {**LONG_BATCH["workload"], "batch_prompt_tokens_mean": 3000},
    }
    fleet = Fleet(config.parse(raw)).run()
    report = build_report(fleet, wall_s=1.0)
    batch = report["tiers"]["batch"]
    assert batch["rejected"] > 0 and batch["length_refused"] > 0 and batch["completed"] > 0
    text = summary(report).splitlines()
    header = text[2].split()
    assert header[:9] == ["tier", "arrived", "done", "cancel", "shed", "quota", "length", "reject", "delayed"]
    row = dict(zip(header, text[3].split()))
    counted = sum(int(row[c]) for c in ("done", "cancel", "shed", "quota", "length", "reject"))
    t = report["totals"]
    assert row["tier"] == "batch" and int(row["arrived"]) == batch["arrived"]
    assert counted + t["unfinished_at_end"] + t["queued_at_end"] == batch["arrived"]
    assert (
        t["requests_ended"]
        + t["requests_refused"]
        + t["requests_rejected"]
        + t["unfinished_at_end"]
        + t["queued_at_end"]
        == t["requests_arrived"]
    )
    assert (
        f"requests {t['requests_arrived']} arrived = {t['requests_ended']} ended + {t['requests_refused']} "
        f"refused + {t['requests_rejected']} rejected + {t['unfinished_at_end']} running + "
        f"{t['queued_at_end']} queued"
    ) in text[1]


DAY = {
    "seed": 2,
    "duration_s": 300,
    "warmup_s": 0,
    "drain_s": 60,
    "fleet": {
        "replicas": 1,
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
        "rate": 5,
        "diurnal_amplitude": 0.8,
        "diurnal_period_s": 300,
        "peak_at_s": 100,
        "think_time_s": 5,
        "output_tokens_mean": 200,
    },
    "gateway": {"quota": False},
}


def test_an_autoscaled_report_counts_the_replicas_it_removed() -> None:
    cold = 30.0
    settings = AutoscaleSettings(
        mode="reactive",
        interval_s=5,
        cold_start_s=cold,
        scale_down_delay_s=30,
        cooldown_s=15,
        pools={"sim": {"min_replicas": 1, "max_replicas": 6, "target_in_flight": 12, "replica_rps": 2.5}},
    )
    fleet = Fleet(config.parse(DAY))
    scaled = ScaledFleet(fleet, ScalingSetup(settings, cold_start_s=cold)).run()
    assert scaled.events["removed"] >= 1 and not scaled.launches
    report = build_report(fleet, wall_s=1.0)
    t, s = report["totals"], report["setup"]
    everyone = fleet.removed + fleet.replicas
    assert len(fleet.removed) == scaled.events["removed"] == s["replicas_removed"]
    assert t["engine_steps"] == sum(r.steps for r in everyone) > sum(r.steps for r in fleet.replicas)
    assert t["preemptions"] == sum(r.scheduler.num_preemptions for r in everyone)
    # the autoscaler's GPU time is the replicas' time in the fleet plus each launch's cold start
    assert t["replica_hours"] == pytest.approx(scaled.gpu_hours - scaled.events["started"] * cold / 3600, abs=1e-4)
    busy = sum(r.busy_s for r in everyone) / (t["replica_hours"] * 3600)
    assert t["replica_busy_share"] == pytest.approx(busy, abs=1e-3)
    assert s["replicas_peak"] > s["replicas"] and s["replicas_at_start"] == 1
    assert f"up to {s['replicas_peak']} replicas (1 at the start, {s['replicas']} at the end)" in summary(report)
