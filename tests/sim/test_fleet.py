"""The whole simulator: same seed, same numbers; the CLI end to end; bad configs refused before anything runs."""

from __future__ import annotations

import gc
import json
from collections import Counter

import pytest
import yaml

from tokenfleet.cli import main
from tokenfleet.sim import config
from tokenfleet.sim.fleet import Fleet
from tokenfleet.sim.report import build_report

TINY = {
    "seed": 3,
    "duration_s": 40,
    "warmup_s": 5,
    "drain_s": 60,
    "fleet": {"replicas": 3, "gpu": "h100", "tensor_parallel": 1, "model": "llama-8b", "weight_dtype": "fp16"},
    "engine": {"num_blocks": 1500},  # small caches, so that the prefix cache and preemption both matter
    "workload": {
        "rate": 25,
        "bursts": [{"at_s": 20, "duration_s": 5, "multiplier": 3}],
        "cancel_probability": 0.1,
        "think_time_s": 3,
    },
    "gateway": {"overload": {"ttft_target_s": 0.5}},
}


def _report(raw: dict, seed: int | None = None) -> dict:
    report = build_report(Fleet(config.parse(raw, seed)).run(), wall_s=1.0)
    report.pop("wall_s"), report.pop("requests_per_wall_minute")
    return report


def test_same_seed_same_numbers_and_another_seed_other_numbers() -> None:
    first, again, other = _report(TINY), _report(TINY), _report(TINY, seed=4)
    assert first == again
    assert other != first
    totals = first["totals"]
    assert totals["requests_arrived"] > 500
    assert totals["prefix_hit_rate"] > 0.3  # conversations come back to their replica
    assert totals["preemptions"] > 0
    assert sum(t["cancelled"] for t in first["tiers"].values()) > 0


def test_parked_decodes_do_not_change_a_fleet_run() -> None:
    slow = {**TINY, "engine": {**TINY["engine"], "fast": False}}
    fast, full = _report(TINY), _report(slow)
    fast["totals"].pop("full_steps"), full["totals"].pop("full_steps")
    assert fast == full


def test_routing_policies_differ_on_prefix_hits() -> None:
    cache_aware = _report(TINY)["totals"]["prefix_hit_rate"]
    round_robin = _report({**TINY, "routing": {"policy": "round_robin"}})["totals"]["prefix_hit_rate"]
    assert cache_aware > round_robin


def test_a_run_leaves_no_reference_cycles_behind() -> None:
    """Runs pause Python's cyclic collector (sim/events.collector_paused), which is only safe while every request's
    objects are freed by reference counting alone; and the collector is on again afterwards."""
    fleet = Fleet(config.parse(TINY))
    gc.collect()
    fleet.run()
    assert gc.isenabled()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        found = gc.collect()
        kinds = Counter(type(o).__name__ for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert fleet.requests_seen > 500
    assert found == 0, f"reference cycles left by the run: {kinds.most_common(5)}"


def test_cli_runs_a_tiny_config_end_to_end(tmp_path, capsys) -> None:
    path = tmp_path / "sim.yaml"
    path.write_text(yaml.safe_dump({**TINY, "duration_s": 15, "warmup_s": 0}))
    assert main(["simulate", "--config", str(path), "--seed", "5", "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["setup"]["seed"] == 5 and report["totals"]["requests_ended"] > 0
    assert "TTFT p50" in capsys.readouterr().out
    assert (tmp_path / "out" / "summary.txt").exists()


def test_the_example_config_is_valid() -> None:
    setup = config.load("deploy/sim.example.yaml")
    assert setup.replicas == 8 and setup.workload.bursts


def test_a_missing_or_broken_config_file_is_a_clear_error(tmp_path, capsys) -> None:
    assert main(["simulate", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "no simulation config" in capsys.readouterr().err
    (tmp_path / "broken.yaml").write_text("fleet: [unclosed")
    assert main(["simulate", "--config", str(tmp_path / "broken.yaml")]) == 2
    assert "not valid YAML" in capsys.readouterr().err


@pytest.mark.parametrize(
    "change, message",
    [
        ({"workload": {"rate": -5}}, "rate must be positive"),
        ({"fleet": {"model": "llama-70b", "weight_dtype": "fp16", "tensor_parallel": 1}}, "does not fit"),
        ({"fleet": {"gpu": "a100"}}, "unknown GPU"),
        ({"fleet": {"tensor_parallel": 3}}, "power of two"),
        ({"fleet": {"replicas": 0}}, "fleet.replicas"),
        ({"workload": {"bursts": [{"at_s": 1, "duration_s": 5, "multiplier": -2}]}}, "burst"),
        ({"workload": {"tiers": {"gold": 1}}}, "unknown tier"),
        ({"routing": {"policy": "random"}}, "routing.policy"),
        ({"fleet": {"replica": 3}}, "unknown setting"),
        ({"duration_s": -1}, "duration_s"),
        ({"autoscale": {}, "disagg": {"prefill_replicas": 1, "decode_replicas": 1}}, "cannot be combined"),
        ({"autoscale": {"settings": {"pools": {"llama-8b": {}}}}}, "one pool named 'sim'"),
        ({"autoscale": {"settings": {"mode": "psychic"}}}, "autoscale.settings: mode must be one of"),
        ({"autoscale": {"cold_start_s": -1}}, "autoscale.cold_start_s"),
        ({"autoscale": {"warm_buffer": 0.2}}, "autoscale: unknown setting"),
        ({"disagg": {"prefill_replicas": 1}}, "disagg.decode_replicas is required"),
        ({"disagg": {"prefill_replicas": 1, "decode_replicas": 1}}, "cancellations"),
        ({"disagg": {"prefill_replicas": 0, "decode_replicas": 1}}, "disagg.prefill_replicas"),
    ],
)
def test_bad_configs_are_refused_before_anything_runs(tmp_path, capsys, change, message) -> None:
    raw = {**TINY, **{k: ({**TINY.get(k, {}), **v} if isinstance(v, dict) else v) for k, v in change.items()}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["simulate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "tokenfleet simulate: error:" in err
